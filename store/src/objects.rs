//! Objects applied at run time (docs/design.md#schedules-as-data): schedules and calendars,
//! each kind a hash of canonical JSON by name (`{ns}:objects:{kind}`) beside a hash of their
//! creation and change times, and one change feed for both (`{ns}:objects:feed`, a stream) that
//! the leader follows instead of rescanning. A put and its feed entry are one script, so the
//! feed never misses a change that was stored.

use super::{Store, StoreError};
use redis::{AsyncCommands, Script};
use std::sync::LazyLock;

/// Objects written per script call by [`Store::put_objects`].
const PUT_PER_CALL: usize = 500;

/// The feed keeps about this many entries; a follower further behind reads everything again
/// ([`FeedRead::Gap`]).
const FEED_MAX_LEN: usize = 100_000;

// PUT
// KEYS[1] -> {ns}:objects:{kind}   KEYS[2] -> {ns}:objects:{kind}:times   KEYS[3] -> the feed
// ARGV[1] -> now (ms)   ARGV[2] -> kind   ARGV[3] -> the feed's length cap
// ARGV[2i+2], ARGV[2i+3] -> object i's name and canonical JSON
// Output: per object 0 unchanged (nothing written), 1 created, 2 replaced (created time kept).
static PUT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local out = {}
for i = 4, #ARGV, 2 do
  local name, body = ARGV[i], ARGV[i + 1]
  local old = redis.call('HGET', KEYS[1], name)
  if old == body then
    out[#out + 1] = 0
  else
    local created = ARGV[1]
    local times = old and redis.call('HGET', KEYS[2], name)
    if times then created = string.match(times, '^(%d+)') or created end
    redis.call('HSET', KEYS[1], name, body)
    redis.call('HSET', KEYS[2], name, created .. ' ' .. ARGV[1])
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*',
      'kind', ARGV[2], 'name', name, 'op', 'put')
    out[#out + 1] = old and 2 or 1
  end
end
return out
"#,
    )
});

// DELETE
// KEYS as PUT; ARGV[1] -> kind, ARGV[2] -> the feed's length cap, ARGV[3..] -> names
// Output: per name 1 deleted, 0 there was none.
static DELETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local out = {}
for i = 3, #ARGV do
  local gone = redis.call('HDEL', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i])
  if gone == 1 then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*',
      'kind', ARGV[1], 'name', ARGV[i], 'op', 'delete')
  end
  out[#out + 1] = gone
end
return out
"#,
    )
});

/// The kinds of object applied at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectKind {
    /// Jobs created at run time.
    Schedule,
    /// Date lists that jobs exclude.
    Calendar,
}

impl ObjectKind {
    /// The kind's name in keys and in the feed.
    pub fn as_str(self) -> &'static str {
        match self {
            ObjectKind::Schedule => "schedules",
            ObjectKind::Calendar => "calendars",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        [ObjectKind::Schedule, ObjectKind::Calendar]
            .into_iter()
            .find(|k| k.as_str() == text)
    }
}

/// What a put did to one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The same object was stored already: nothing written.
    Unchanged,
    /// A new name.
    Created,
    /// The object replaced another of its name.
    Replaced,
}

/// One stored object with its times (ms since the epoch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Its name.
    pub name: String,
    /// Its canonical JSON.
    pub json: String,
    /// When it was first created.
    pub created_ms: i64,
    /// When it last changed.
    pub updated_ms: i64,
}

/// One change in the feed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The stream entry's id: where to read on from.
    pub id: String,
    /// Which kind of object changed.
    pub kind: ObjectKind,
    /// Its name.
    pub name: String,
    /// Put (`false`) or deleted (`true`).
    pub deleted: bool,
}

/// What reading the feed on from an id gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeedRead {
    /// The changes after the id, oldest first (none: nothing changed).
    Changes(Vec<Change>),
    /// Entries after the id were trimmed away: read every object again.
    Gap,
}

impl Store {
    /// Stores each `(name, canonical JSON)` of `kind`, one feed entry per object that changed;
    /// `now_ms` is the change time. One round trip per `PUT_PER_CALL` objects.
    pub async fn put_objects(
        &self,
        kind: ObjectKind,
        objects: &[(String, String)],
        now_ms: i64,
    ) -> Result<Vec<Applied>, StoreError> {
        let mut out = Vec::with_capacity(objects.len());
        let mut conn = self.conn.clone();
        for chunk in objects.chunks(PUT_PER_CALL) {
            let mut call = PUT.prepare_invoke();
            self.object_keys(&mut call, kind);
            call.arg(now_ms).arg(kind.as_str()).arg(FEED_MAX_LEN);
            for (name, json) in chunk {
                call.arg(name).arg(json);
            }
            let codes: Vec<i64> = call.invoke_async(&mut conn).await?;
            out.extend(codes.into_iter().map(|c| match c {
                0 => Applied::Unchanged,
                1 => Applied::Created,
                _ => Applied::Replaced,
            }));
        }
        Ok(out)
    }

    /// Deletes `names` of `kind`: per name, whether one was stored.
    pub async fn delete_objects(
        &self,
        kind: ObjectKind,
        names: &[&str],
    ) -> Result<Vec<bool>, StoreError> {
        let mut call = DELETE.prepare_invoke();
        self.object_keys(&mut call, kind);
        call.arg(kind.as_str()).arg(FEED_MAX_LEN).arg(names);
        let codes: Vec<i64> = call.invoke_async(&mut self.conn.clone()).await?;
        Ok(codes.into_iter().map(|c| c == 1).collect())
    }

    fn object_keys(&self, call: &mut redis::ScriptInvocation<'_>, kind: ObjectKind) {
        call.key(self.names.objects(kind.as_str()))
            .key(self.names.object_times(kind.as_str()))
            .key(self.names.object_feed());
    }

    /// The object `name` of `kind`, if stored.
    pub async fn object(&self, kind: ObjectKind, name: &str) -> Result<Option<Stored>, StoreError> {
        let mut found = self.objects_named(kind, &[name.to_owned()]).await?;
        Ok(found.pop().flatten())
    }

    /// The objects `names` of `kind`, in order (`None`: not stored).
    pub async fn objects_named(
        &self,
        kind: ObjectKind,
        names: &[String],
    ) -> Result<Vec<Option<Stored>>, StoreError> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.conn.clone();
        let (bodies, times): (Vec<Option<String>>, Vec<Option<String>>) = redis::pipe()
            .hmget(self.names.objects(kind.as_str()), names)
            .hmget(self.names.object_times(kind.as_str()), names)
            .query_async(&mut conn)
            .await?;
        let found = names.iter().zip(bodies).zip(times);
        Ok(found
            .map(|((name, json), times)| Some(stored(name.clone(), json?, times.as_deref())))
            .collect())
    }

    /// One page of the objects of `kind` (about `count`, in no order) from `cursor` (0 first),
    /// and the cursor of the next page (0: this was the last).
    pub async fn objects_page(
        &self,
        kind: ObjectKind,
        cursor: u64,
        count: usize,
    ) -> Result<(u64, Vec<Stored>), StoreError> {
        let (next, pairs) = self.object_bodies_page(kind, cursor, count).await?;
        let names: Vec<String> = pairs.into_iter().map(|(name, _)| name).collect();
        let found = self.objects_named(kind, &names).await?;
        Ok((next, found.into_iter().flatten().collect()))
    }

    /// One page of the objects of `kind` as [`Store::objects_page`] gives them, but only each
    /// one's name and JSON, as the scan itself returns them: one round trip a page, where a
    /// page with its times is three (a beat reads a million at start; docs/performance.md).
    pub async fn object_bodies_page(
        &self,
        kind: ObjectKind,
        cursor: u64,
        count: usize,
    ) -> Result<(u64, Vec<(String, String)>), StoreError> {
        let mut conn = self.conn.clone();
        let (next, pairs): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
            .arg(self.names.objects(kind.as_str()))
            .arg(cursor)
            .arg("COUNT")
            .arg(count)
            .query_async(&mut conn)
            .await?;
        Ok((next, pairs))
    }

    /// How many objects of `kind` are stored.
    pub async fn object_count(&self, kind: ObjectKind) -> Result<u64, StoreError> {
        let mut conn = self.conn.clone();
        Ok(conn.hlen(self.names.objects(kind.as_str())).await?)
    }

    /// The id of the feed's newest entry (`0-0` when empty): read every object after taking
    /// it, then follow the feed from it, and no change is missed.
    pub async fn feed_head(&self) -> Result<String, StoreError> {
        let mut conn = self.conn.clone();
        let last: Vec<Entry> = redis::cmd("XREVRANGE")
            .arg(self.names.object_feed())
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .query_async(&mut conn)
            .await?;
        Ok(last.into_iter().next().map_or("0-0".into(), |(id, _)| id))
    }

    /// The feed's changes after `after`, at most `count`, waiting up to `block_ms` for one
    /// when there is none (0: not at all).
    pub async fn feed_since(
        &self,
        after: &str,
        count: usize,
        block_ms: u64,
    ) -> Result<FeedRead, StoreError> {
        let mut conn = self.conn.clone();
        let feed = self.names.object_feed();
        let first: Vec<Entry> = redis::cmd("XRANGE")
            .arg(&feed)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .query_async(&mut conn)
            .await?;
        if let Some((first, _)) = first.first() {
            // `after` itself trimmed away: changes after it may have gone with it.
            if after != "0-0" && stream_id(first) > stream_id(after) {
                return Ok(FeedRead::Gap);
            }
        }
        let mut read = redis::cmd("XREAD");
        read.arg("COUNT").arg(count);
        if block_ms > 0 {
            read.arg("BLOCK").arg(block_ms);
        }
        let reply: Option<Vec<(String, Vec<Entry>)>> = read
            .arg("STREAMS")
            .arg(&feed)
            .arg(after)
            .query_async(&mut conn)
            .await?;
        let entries = reply.into_iter().flatten().flat_map(|(_, entries)| entries);
        Ok(FeedRead::Changes(entries.filter_map(change).collect()))
    }
}

/// A stream entry as Redis gives it: its id and its fields.
type Entry = (String, Vec<(String, String)>);

/// A stored object from its hash fields.
fn stored(name: String, json: String, times: Option<&str>) -> Stored {
    let mut times = times
        .unwrap_or("")
        .split(' ')
        .map(|t| t.parse().unwrap_or(0));
    let created_ms = times.next().unwrap_or(0);
    Stored {
        name,
        json,
        created_ms,
        updated_ms: times.next().unwrap_or(created_ms),
    }
}

/// A feed entry as a [`Change`]; `None` for one of a shape we never write.
fn change((id, fields): Entry) -> Option<Change> {
    let field = |key: &str| {
        fields
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    };
    Some(Change {
        kind: ObjectKind::parse(field("kind")?)?,
        name: field("name")?.to_owned(),
        deleted: field("op")? == "delete",
        id,
    })
}

/// A stream id `MS-SEQ` as numbers, for ordering.
fn stream_id(id: &str) -> Option<(u64, u64)> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}
