//! Schedules applied at run time from Rust (docs/api.md): the same operations as `drumline
//! schedules apply|get|list|delete`, through the HTTP API a beat serves (`--api-addr`), so a
//! program needs neither Redis nor the config to create one job per customer.
//!
//! ```no_run
//! # async fn demo() -> Result<(), drumline_client::ScheduleError> {
//! use drumline_client::{Applied, Schedules};
//! use serde_json::json;
//! let schedules = Schedules::new("http://127.0.0.1:8080", "s3cret")?;
//! let report = json!({"task": "report", "cron": "0 6 * * *", "labels": {"tenant": "acme"}});
//! assert_eq!(schedules.apply("acme-report", &report).await?, Applied::Created);
//! let stored = schedules.get("acme-report").await?.expect("stored");
//! println!("next: {}", stored["next"]);
//! let acme = schedules.list(Some(("tenant", "acme"))).await?;
//! schedules.delete("acme-report").await?;
//! # Ok(()) }
//! ```

use serde_json::Value;

/// What an apply did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// A new schedule (`201`).
    Created,
    /// Replaced, or unchanged (`200`).
    Replaced,
}

/// Why a schedules call failed.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    /// The API refused the schedule (`400`; `409`: a name of the config file): its error and
    /// the offending key.
    #[error("refused ({status}): {error}{}", field.as_ref().map(|f| format!(" (key `{f}`)")).unwrap_or_default())]
    Refused {
        /// The HTTP status.
        status: u16,
        /// What is wrong.
        error: String,
        /// The offending key, when one is.
        field: Option<String>,
    },
    /// No or a wrong token (`401`).
    #[error("the API refused the token (401)")]
    Unauthorized,
    /// The API could not be reached, or answered what it never answers.
    #[error("the API: {0}")]
    Http(String),
}

/// A beat's HTTP API, for schedules.
#[derive(Debug, Clone)]
pub struct Schedules {
    base: String,
    token: String,
    http: reqwest::Client,
}

impl Schedules {
    /// The API at `base` (`http://HOST:PORT`), every request carrying `token`.
    pub fn new(base: &str, token: &str) -> Result<Self, ScheduleError> {
        let http = reqwest::Client::builder()
            .build()
            .map_err(|e| ScheduleError::Http(e.to_string()))?;
        Ok(Schedules {
            base: base.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
            http,
        })
    }

    /// Creates or replaces schedule `name` (`schedule`: the keys of a `[[jobs]]` table plus
    /// `labels`).
    pub async fn apply(&self, name: &str, schedule: &Value) -> Result<Applied, ScheduleError> {
        let url = format!("{}/api/v1/schedules/{name}", self.base);
        let request = self.http.put(url).body(schedule.to_string());
        match self.send(request).await? {
            (201, _) => Ok(Applied::Created),
            (200, _) => Ok(Applied::Replaced),
            (status, body) => Err(refused(status, body)),
        }
    }

    /// Schedule `name` as stored (with `source`, `created_at`, `updated_at`, `next`), `None`
    /// when there is none.
    pub async fn get(&self, name: &str) -> Result<Option<Value>, ScheduleError> {
        let url = format!("{}/api/v1/schedules/{name}", self.base);
        match self.send(self.http.get(url)).await? {
            (200, body) => Ok(Some(body)),
            (404, _) => Ok(None),
            (status, body) => Err(refused(status, body)),
        }
    }

    /// Every schedule (the config's jobs too, unless a `label` `(K, V)` is asked for), page
    /// after page.
    pub async fn list(&self, label: Option<(&str, &str)>) -> Result<Vec<Value>, ScheduleError> {
        let mut all = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let mut query = vec![("limit", "1000".to_owned())];
            query.extend(label.map(|(k, v)| ("label", format!("{k}={v}"))));
            query.extend(cursor.map(|c| ("cursor", c)));
            let url = format!("{}/api/v1/schedules", self.base);
            let (status, mut page) = self.send(self.http.get(url).query(&query)).await?;
            if status != 200 {
                return Err(refused(status, page));
            }
            if let Value::Array(rows) = page["schedules"].take() {
                all.extend(rows);
            }
            cursor = page["next_cursor"].as_str().map(str::to_owned);
            if cursor.is_none() {
                return Ok(all);
            }
        }
    }

    /// Deletes schedule `name`: whether there was one.
    pub async fn delete(&self, name: &str) -> Result<bool, ScheduleError> {
        let url = format!("{}/api/v1/schedules/{name}", self.base);
        match self.send(self.http.delete(url)).await? {
            (204, _) => Ok(true),
            (404, _) => Ok(false),
            (status, body) => Err(refused(status, body)),
        }
    }

    /// Sends `request` with the token: the status and the JSON body (`null` when empty).
    async fn send(&self, request: reqwest::RequestBuilder) -> Result<(u16, Value), ScheduleError> {
        let answer = request
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|e| ScheduleError::Http(e.to_string()))?;
        let status = answer.status().as_u16();
        if status == 401 {
            return Err(ScheduleError::Unauthorized);
        }
        let text = answer
            .text()
            .await
            .map_err(|e| ScheduleError::Http(e.to_string()))?;
        Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
    }
}

/// An error answer as a [`ScheduleError`].
fn refused(status: u16, body: Value) -> ScheduleError {
    match body["error"].as_str() {
        Some(error) => ScheduleError::Refused {
            status,
            error: error.to_owned(),
            field: body["field"].as_str().map(str::to_owned),
        },
        None => ScheduleError::Http(format!("answered {status}: {body}")),
    }
}
