//! Broker and Redis URLs (docs/design.md "URLs and TLS"): checked when the config is loaded, and
//! never printed with their password ([`Redacted`] shows it as `***`).
//!
//! A URL that does not parse is refused without echoing it: the input may hold a password in
//! a place the parser did not recognise (`amqp:u:s3cret@h`), so no error here quotes it.

use std::fmt;

/// Schemes accepted for `[broker] url` / `DRUMLINE_AMQP_URL`.
pub const AMQP_SCHEMES: &[&str] = &["amqp", "amqps"];
/// Schemes accepted for `[redis] url` / `DRUMLINE_REDIS_URL`.
pub const REDIS_SCHEMES: &[&str] = &["redis", "rediss", "redis+sentinel"];

/// Why a URL is refused. No variant carries the URL or any part of it after the scheme.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// Not `SCHEME://…` at all, or the parser refused it.
    #[error("is not a valid URL ({reason}); write {example}")]
    Malformed {
        /// What the parser said (never the input).
        reason: String,
        /// The expected shape.
        example: &'static str,
    },
    /// A scheme this key does not take.
    #[error("scheme {scheme:?} is not supported here; use one of: {expected}")]
    Scheme {
        /// The scheme given.
        scheme: String,
        /// The schemes this key takes.
        expected: String,
    },
}

const AMQP_EXAMPLE: &str = "amqp[s]://USER:PASSWORD@HOST[:PORT]/VHOST";
const REDIS_EXAMPLE: &str = "redis[s]://[[USER]:PASSWORD@]HOST[:PORT][/DB]";
const SENTINEL_EXAMPLE: &str =
    "redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT…]/MASTER_NAME[/DB]";

fn malformed(reason: impl Into<String>, example: &'static str) -> UrlError {
    UrlError::Malformed {
        reason: reason.into(),
        example,
    }
}

/// Parses the generic `scheme://authority/path` shape with the `url` crate and checks the
/// scheme against `schemes`. The crate's messages describe the problem, never the input.
fn parse_hierarchical(
    text: &str,
    schemes: &[&str],
    example: &'static str,
) -> Result<::url::Url, UrlError> {
    let url = ::url::Url::parse(text).map_err(|e| malformed(e.to_string(), example))?;
    if !schemes.contains(&url.scheme()) {
        return Err(UrlError::Scheme {
            scheme: url.scheme().to_owned(),
            expected: schemes.join(", "),
        });
    }
    if url.cannot_be_a_base() || !text[url.scheme().len()..].starts_with("://") {
        return Err(malformed("expected \"://\" after the scheme", example));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(malformed("no host", example));
    }
    Ok(url)
}

/// Checks a broker URL: `amqp://` or `amqps://` with a host, as lapin will read it.
pub fn check_amqp(text: &str) -> Result<(), UrlError> {
    parse_hierarchical(text, AMQP_SCHEMES, AMQP_EXAMPLE)?;
    // lapin's own parser has the last word (query options, vhost); its messages quote the
    // input, so only the fact of refusal is reported.
    text.parse::<amq_protocol_uri::AMQPUri>()
        .map_err(|_| malformed("the AMQP client cannot read it", AMQP_EXAMPLE))?;
    Ok(())
}

/// Checks a Redis URL: `redis://`, `rediss://` (host, optional numeric DB) or
/// `redis+sentinel://` (see [`parse_sentinel`]).
pub fn check_redis(text: &str) -> Result<(), UrlError> {
    if let Some(rest) = text.strip_prefix("redis+sentinel:") {
        return check_sentinel(rest);
    }
    let url = parse_hierarchical(text, REDIS_SCHEMES, REDIS_EXAMPLE)?;
    match url.path() {
        "" | "/" => {}
        path if path[1..].parse::<u32>().is_ok() => {}
        _ => {
            return Err(malformed(
                "the path must be a database number",
                REDIS_EXAMPLE,
            ))
        }
    }
    Ok(())
}

/// `redis+sentinel://[:PASSWORD@]host:port[,host:port…]/MASTER_NAME[/DB]` after the scheme's
/// colon (docs/design.md "Scale-out").
fn check_sentinel(rest: &str) -> Result<(), UrlError> {
    parse_sentinel_rest(rest).map(drop)
}

/// A `redis+sentinel://` URL, read: the Sentinels to ask (in order), the name of the primary
/// they watch, and how to talk to the data nodes (password, database). `Debug` hides the
/// password.
#[derive(Clone, PartialEq, Eq)]
pub struct SentinelUrl {
    /// `(host, port)` of each Sentinel, in the order given.
    pub sentinels: Vec<(String, u16)>,
    /// The master name the Sentinels monitor.
    pub master: String,
    /// The data nodes' password (the Sentinels are asked without one).
    pub password: Option<String>,
    /// The database number (default 0).
    pub db: i64,
}

impl fmt::Debug for SentinelUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelUrl")
            .field("sentinels", &self.sentinels)
            .field("master", &self.master)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("db", &self.db)
            .finish()
    }
}

/// Reads a `redis+sentinel://` URL; `None` for any other scheme. Errors never quote the input.
pub fn parse_sentinel(text: &str) -> Option<Result<SentinelUrl, UrlError>> {
    text.strip_prefix("redis+sentinel:")
        .map(parse_sentinel_rest)
}

fn parse_sentinel_rest(rest: &str) -> Result<SentinelUrl, UrlError> {
    let bad = |reason: &str| malformed(reason, SENTINEL_EXAMPLE);
    let rest = rest
        .strip_prefix("//")
        .ok_or_else(|| bad("expected \"://\" after the scheme"))?;
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let (password, hosts) = match authority.rfind('@') {
        Some(at) => {
            let password = authority[..at]
                .strip_prefix(':')
                .ok_or_else(|| bad("the part before '@' must be \":PASSWORD\""))?;
            let password = percent_decode(password)
                .ok_or_else(|| bad("the password is not valid percent-encoded UTF-8"))?;
            (Some(password), &authority[at + 1..])
        }
        None => (None, authority),
    };
    let mut sentinels = Vec::new();
    for host_port in hosts.split(',') {
        let (host, port) = host_port
            .rsplit_once(':')
            .ok_or_else(|| bad("every sentinel needs HOST:PORT"))?;
        let port = port.parse::<u16>().ok().filter(|p| *p != 0);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        match port {
            Some(port) if !host.is_empty() => sentinels.push((host.to_owned(), port)),
            _ => return Err(bad("every sentinel needs HOST:PORT")),
        }
    }
    let mut parts = path.strip_prefix('/').unwrap_or("").split('/');
    let master = parts.next().unwrap_or("");
    if master.is_empty() || master.contains(['?', '#']) {
        return Err(bad("no master name"));
    }
    let db = match parts.next() {
        None | Some("") => 0,
        Some(db) => db
            .parse::<u32>()
            .map_err(|_| bad("the database must be a number"))?
            .into(),
    };
    if parts.next().is_some() {
        return Err(bad("too many path segments"));
    }
    Ok(SentinelUrl {
        sentinels,
        master: master.to_owned(),
        password: password.filter(|p| !p.is_empty()),
        db,
    })
}

/// `%XX` escapes decoded (a password may hold `@`, `/`, `,` or `:` that way).
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Displays a URL with its password shown as `***`
/// (`amqp://app:***@mq:5672/%2f`). Text without `://` is not shown at all.
#[derive(Debug, Clone, Copy)]
pub struct Redacted<'a>(pub &'a str);

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.0;
        let Some(start) = text.find("://").map(|i| i + 3) else {
            return f.write_str("<URL not shown>");
        };
        let end = text[start..]
            .find(['/', '?', '#'])
            .map_or(text.len(), |i| start + i);
        let authority = &text[start..end];
        match authority.rfind('@') {
            Some(at) => match authority[..at].find(':') {
                Some(colon) => write!(
                    f,
                    "{}{}:***{}",
                    &text[..start],
                    &authority[..colon],
                    &text[start + at..]
                ),
                None => f.write_str(text),
            },
            None => f.write_str(text),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_urls_pass() {
        for u in [
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            "amqps://app:pw@mq.example.com/prod",
            "amqp://localhost",
        ] {
            assert_eq!(check_amqp(u), Ok(()), "{u}");
        }
        for u in [
            "redis://127.0.0.1:6379/0",
            "redis://:pw@r:6379",
            "rediss://user:pw@r.example.com:6380/2",
            "redis+sentinel://:pw@s1:26379,s2:26379/mymaster/0",
            "redis+sentinel://s1:26379/mymaster",
        ] {
            assert_eq!(check_redis(u), Ok(()), "{u}");
        }
    }

    #[test]
    fn bad_urls_are_refused_without_echoing_them() {
        for u in [
            "amqp:u:s3cret@h",
            "amqp//u:s3cret@h",
            "u:s3cret@h",
            "amqp://u:s3cret@",
            "http://u:s3cret@h/",
            "amqp://u:s3cret@h:99999/",
            "redis://u:s3cret@h/notadb",
        ] {
            let check = if u.starts_with("redis") {
                check_redis
            } else {
                check_amqp
            };
            let e = check(u).expect_err(u).to_string();
            assert!(!e.contains("s3cret"), "{u}: {e}");
        }
        for u in [
            "redis+sentinel:u:s3cret@h",
            "redis+sentinel://u:s3cret@s1:26379/m",
            "redis+sentinel://:s3cret@s1/m",
            "redis+sentinel://:s3cret@s1:26379,s2/m",
            "redis+sentinel://:s3cret@s1:26379",
            "redis+sentinel://:s3cret@s1:26379/m/x",
            "redis://:s3cret@h:6379,h2:6379/0",
            "amqp://:s3cret@h:1/",
        ] {
            match check_redis(u) {
                Ok(()) => panic!("{u} accepted"),
                Err(e) => assert!(!e.to_string().contains("s3cret"), "{u}: {e}"),
            }
        }
        assert!(matches!(
            check_amqp("redis://h"),
            Err(UrlError::Scheme { .. })
        ));
    }

    #[test]
    fn sentinel_urls_are_read_into_their_parts() {
        let u = parse_sentinel("redis+sentinel://:p%40ss@s1:26379,10.0.0.2:26380/mymaster/3")
            .expect("sentinel scheme")
            .expect("valid");
        assert_eq!(
            u.sentinels,
            vec![("s1".to_owned(), 26379), ("10.0.0.2".to_owned(), 26380)]
        );
        assert_eq!(
            (u.master.as_str(), u.password.as_deref(), u.db),
            ("mymaster", Some("p@ss"), 3)
        );
        assert!(!format!("{u:?}").contains("p@ss"), "{u:?}");
        let u = parse_sentinel("redis+sentinel://s1:26379/m")
            .unwrap()
            .unwrap();
        assert_eq!((u.sentinels.len(), u.password, u.db), (1, None, 0));
        let u = parse_sentinel("redis+sentinel://[::1]:26379/m/")
            .unwrap()
            .unwrap();
        assert_eq!((u.sentinels[0].0.as_str(), u.db), ("::1", 0));
        assert!(parse_sentinel("redis://h:6379/0").is_none());
        for bad in [
            "redis+sentinel://s1:26379,/m",
            "redis+sentinel://s1:0/m",
            "redis+sentinel://:s3cret@s1:26379//0",
            "redis+sentinel://:s3cr%zzet@s1:26379/m",
            "redis+sentinel:///m",
        ] {
            let e = parse_sentinel(bad).unwrap().expect_err(bad).to_string();
            assert!(!e.contains("s3cr"), "{bad}: {e}");
            assert!(e.contains("redis+sentinel://"), "{bad}: {e}");
        }
    }

    #[test]
    fn redacted_hides_the_password_only() {
        let r = |u: &str| Redacted(u).to_string();
        assert_eq!(
            r("amqp://app:s3cret@mq:5672/%2f"),
            "amqp://app:***@mq:5672/%2f"
        );
        assert_eq!(r("redis://:s3cret@r:6379/0"), "redis://:***@r:6379/0");
        assert_eq!(r("rediss://u:p@ss@r/0"), "rediss://u:***@r/0");
        assert_eq!(
            r("redis+sentinel://:s3cret@a:1,b:2/m/0"),
            "redis+sentinel://:***@a:1,b:2/m/0"
        );
        assert_eq!(r("redis://r:6379/0"), "redis://r:6379/0");
        assert_eq!(r("amqp://user@h/"), "amqp://user@h/");
        assert_eq!(r("amqp:u:s3cret@h"), "<URL not shown>");
    }
}
