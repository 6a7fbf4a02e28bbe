//! The one connection every [`Store`](super::Store) call goes through (docs/design.md "Scale-out").
//!
//! With `redis://` or `rediss://` it is a redis-rs `ConnectionManager` and nothing more. With
//! `redis+sentinel://` the primary is asked of the Sentinels (each in turn, in URL order) at
//! connect, and again after a connection error, a `READONLY` reply or a `WAIT` that fell short
//! ([`Conn::primary_in_doubt`]: a primary cut off from its replicas while its clients still
//! reach it may have been replaced, and nothing else would tell them): when they name another
//! primary, the manager is swapped for one connected to it, so the beat and the workers follow
//! a failover without a restart. The call that saw the error still fails (the caller fails
//! closed, as with any Redis error); only the calls after the swap go to the new primary.

use super::StoreError;
use crate::url::SentinelUrl;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{
    AsyncConnectionConfig, Client, Cmd, ConnectionAddr, ErrorKind, IntoConnectionInfo, Pipeline,
    RedisConnectionInfo, RedisFuture, ServerErrorKind, Value,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// How long one Sentinel may take to connect and answer.
const SENTINEL_TIMEOUT: Duration = Duration::from_secs(1);
/// Sentinels are asked at most this often (every failing call would ask otherwise).
const ASK_EVERY: Duration = Duration::from_millis(200);

/// A cheap-to-clone connection that follows the primary (see the module docs).
#[derive(Clone)]
pub struct Conn {
    shared: Arc<Shared>,
}

struct Shared {
    current: RwLock<Current>,
    sentinel: Option<Sentinel>,
}

struct Current {
    manager: ConnectionManager,
    /// The primary's address (Sentinel only).
    primary: Option<(String, u16)>,
}

struct Sentinel {
    url: SentinelUrl,
    /// A refresh is under way (at most one at a time).
    refreshing: AtomicBool,
    /// When the last refresh ended.
    last: Mutex<Option<Instant>>,
}

/// The manager's settings, the same for every URL kind.
pub(super) fn manager_config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(Some(Duration::from_secs(5)))
        .set_number_of_retries(1)
}

impl Conn {
    /// A plain (non-Sentinel) connection.
    pub(super) fn plain(manager: ConnectionManager) -> Self {
        Self::new(manager, None, None)
    }

    /// Asks the Sentinels of `url` for the primary and connects to it.
    pub(super) async fn sentinel(url: SentinelUrl) -> Result<Self, StoreError> {
        let primary = ask_sentinels(&url).await?;
        let manager = connect_primary(&url, &primary).await?;
        Ok(Self::new(manager, Some(primary), Some(url)))
    }

    fn new(
        manager: ConnectionManager,
        primary: Option<(String, u16)>,
        url: Option<SentinelUrl>,
    ) -> Self {
        let sentinel = url.map(|url| Sentinel {
            url,
            refreshing: AtomicBool::new(false),
            last: Mutex::new(None),
        });
        Self {
            shared: Arc::new(Shared {
                current: RwLock::new(Current { manager, primary }),
                sentinel,
            }),
        }
    }

    fn manager(&self) -> ConnectionManager {
        let current = self
            .shared
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        current.manager.clone()
    }

    /// The primary this connection writes to (`None` without Sentinel).
    pub fn primary(&self) -> Option<(String, u16)> {
        let current = self
            .shared
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        current.primary.clone()
    }

    /// The primary may have been replaced though it still answers (a `WAIT` fell short): ask
    /// the Sentinels again, in the background. Nothing without Sentinel.
    pub(super) fn primary_in_doubt(&self) {
        self.refresh();
    }

    /// After a failed call: ask the Sentinels again (in the background) when the failure can
    /// mean the primary moved.
    fn saw_error(&self, e: &redis::RedisError) {
        if may_have_failed_over(e) {
            self.refresh();
        }
    }

    /// After a pipeline: a `READONLY` reply inside it means we write to a replica.
    fn saw_values(&self, values: &[Value]) {
        let readonly = values.iter().any(
            |v| matches!(v, Value::ServerError(e) if e.kind() == Some(ServerErrorKind::ReadOnly)),
        );
        if readonly {
            self.refresh();
        }
    }

    fn refresh(&self) {
        let Some(sentinel) = &self.shared.sentinel else {
            return;
        };
        if sentinel.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let shared = Arc::clone(&self.shared);
        tokio::spawn(async move {
            let Some(sentinel) = &shared.sentinel else {
                return;
            };
            let last = *sentinel.last.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(wait) =
                last.and_then(|l| (l + ASK_EVERY).checked_duration_since(Instant::now()))
            {
                tokio::time::sleep(wait).await;
            }
            shared.follow(&sentinel.url).await;
            *sentinel.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
            sentinel.refreshing.store(false, Ordering::Release);
        });
    }
}

impl Shared {
    /// Asks the Sentinels for the primary; when it is not the one we use, connects to it and
    /// swaps the manager. Any failure leaves the current manager in place (its calls keep
    /// failing, and the next failure asks again).
    async fn follow(&self, url: &SentinelUrl) {
        let primary = match ask_sentinels(url).await {
            Ok(primary) => primary,
            Err(e) => {
                warn!(error = %e, "no sentinel named a primary; asking again at the next error");
                return;
            }
        };
        let old = self
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .primary
            .clone();
        if old.as_ref() == Some(&primary) {
            return;
        }
        match connect_primary(url, &primary).await {
            Ok(manager) => {
                let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
                *current = Current {
                    manager,
                    primary: Some(primary.clone()),
                };
                info!(
                    from = ?old.map(|(h, p)| format!("{h}:{p}")),
                    to = %format!("{}:{}", primary.0, primary.1),
                    master = %url.master,
                    "following the new redis primary"
                );
            }
            Err(e) => warn!(error = %e, "cannot connect to the primary the sentinels name"),
        }
    }
}

/// A connection-level error or a `READONLY` reply: the primary may have moved.
fn may_have_failed_over(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
        || matches!(
            e.kind(),
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        )
        || e.code() == Some("READONLY")
}

/// `SENTINEL get-master-addr-by-name` of each Sentinel in turn: the first address named wins.
async fn ask_sentinels(url: &SentinelUrl) -> Result<(String, u16), StoreError> {
    let mut last = None;
    for (host, port) in &url.sentinels {
        match ask_sentinel(host, *port, &url.master).await {
            Ok(Some(primary)) => return Ok(primary),
            Ok(None) => {
                last = Some(StoreError::NoPrimary(format!(
                    "{host}:{port} does not monitor the master name {:?}",
                    url.master
                )))
            }
            Err(e) => {
                last = Some(StoreError::NoPrimary(format!(
                    "{host}:{port} did not answer: {e}"
                )))
            }
        }
    }
    Err(last.unwrap_or_else(|| StoreError::NoPrimary("no sentinel in the URL".into())))
}

async fn ask_sentinel(
    host: &str,
    port: u16,
    master: &str,
) -> Result<Option<(String, u16)>, StoreError> {
    let info = ConnectionAddr::Tcp(host.to_owned(), port)
        .into_connection_info()?
        .set_redis_settings(RedisConnectionInfo::default().set_skip_set_lib_name());
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(SENTINEL_TIMEOUT))
        .set_response_timeout(Some(SENTINEL_TIMEOUT));
    let mut conn = Client::open(info)?
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    redis::cmd("SENTINEL")
        .arg("get-master-addr-by-name")
        .arg(master)
        .query_async(&mut conn)
        .await
        .map_err(StoreError::from)
}

async fn connect_primary(
    url: &SentinelUrl,
    (host, port): &(String, u16),
) -> Result<ConnectionManager, StoreError> {
    let mut redis = RedisConnectionInfo::default().set_db(url.db);
    if let Some(password) = &url.password {
        redis = redis.set_password(password);
    }
    let info = ConnectionAddr::Tcp(host.clone(), *port)
        .into_connection_info()?
        .set_redis_settings(redis);
    Ok(ConnectionManager::new_with_config(Client::open(info)?, manager_config()).await?)
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let result = self.manager().req_packed_command(cmd).await;
            match &result {
                Err(e) => self.saw_error(e),
                Ok(Value::ServerError(e)) if e.kind() == Some(ServerErrorKind::ReadOnly) => {
                    self.refresh()
                }
                Ok(_) => {}
            }
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let result = self
                .manager()
                .req_packed_commands(pipeline, offset, count)
                .await;
            match &result {
                Err(e) => self.saw_error(e),
                Ok(values) => self.saw_values(values),
            }
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.manager().get_db()
    }
}
