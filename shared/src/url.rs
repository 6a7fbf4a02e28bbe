//! Broker and Redis URLs (DESIGN §9 "URLs and TLS"): checked when the config is loaded, and
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
    text.parse::<lapin::uri::AMQPUri>()
        .map_err(|_| malformed("the AMQP client cannot read it", AMQP_EXAMPLE))?;
    Ok(())
}

/// Checks a Redis URL: `redis://`, `rediss://` (host, optional numeric DB) or
/// `redis+sentinel://` (shape only, see [`check_sentinel`]).
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
/// colon (DESIGN §9 "Scale-out"). Only the shape is checked.
fn check_sentinel(rest: &str) -> Result<(), UrlError> {
    let bad = |reason: &str| malformed(reason, SENTINEL_EXAMPLE);
    let rest = rest
        .strip_prefix("//")
        .ok_or_else(|| bad("expected \"://\" after the scheme"))?;
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let hosts = match authority.rfind('@') {
        Some(at) => {
            if !authority[..at].starts_with(':') {
                return Err(bad("the part before '@' must be \":PASSWORD\""));
            }
            &authority[at + 1..]
        }
        None => authority,
    };
    for host_port in hosts.split(',') {
        let (host, port) = host_port
            .rsplit_once(':')
            .ok_or_else(|| bad("every sentinel needs HOST:PORT"))?;
        if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
            return Err(bad("every sentinel needs HOST:PORT"));
        }
    }
    let mut parts = path.strip_prefix('/').unwrap_or("").split('/');
    let master = parts.next().unwrap_or("");
    if master.is_empty() || master.contains(['?', '#']) {
        return Err(bad("no master name"));
    }
    if let Some(db) = parts.next() {
        if db.parse::<u32>().is_err() {
            return Err(bad("the database must be a number"));
        }
    }
    if parts.next().is_some() {
        return Err(bad("too many path segments"));
    }
    Ok(())
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
