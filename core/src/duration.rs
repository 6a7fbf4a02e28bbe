//! Durations as humantime strings ("30s", "10m", "7d"), in config and on the command line.

use std::time::Duration;

/// Parses a humantime duration such as `"30s"` or `"1h 30m"`.
pub fn parse(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim()).map_err(|e| {
        format!("{text:?} is not a duration ({e}); write e.g. \"30s\", \"10m\", \"7d\"")
    })
}

/// Formats a duration the way config files write them.
pub fn format(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_config_style_durations() {
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("7d"), Ok(Duration::from_secs(7 * 86400)));
        assert_eq!(parse("1h 30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
    }

    #[test]
    fn rejects_garbage_with_an_example() {
        let err = parse("ten seconds").unwrap_err();
        assert!(err.contains("\"ten seconds\""), "{err}");
        assert!(err.contains("30s"), "{err}");
        assert!(parse("30").is_err());
    }
}
