//! Durations given on the command line as seconds: clap value parsers that reject what
//! `Duration::from_secs_f64` would panic on (negative, NaN, infinite).
use std::time::Duration;

/// Seconds, zero or more: `--drain-timeout 0` means no wait.
pub fn seconds(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    Duration::try_from_secs_f64(v)
        .map_err(|_| format!("{s:?} must be a finite, non-negative number of seconds"))
}

/// Seconds, more than zero: for timeouts, where zero would fail at once.
pub fn positive_seconds(s: &str) -> Result<Duration, String> {
    match seconds(s)? {
        d if d.is_zero() => Err(format!("{s:?} must be more than zero seconds")),
        d => Ok(d),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_non_negative_seconds() {
        assert_eq!(seconds("0"), Ok(Duration::ZERO));
        assert_eq!(seconds("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(positive_seconds(" 20 "), Ok(Duration::from_secs(20)));
    }

    #[test]
    fn rejects_what_would_panic() {
        for bad in ["-1", "-0.5", "NaN", "inf", "abc", ""] {
            assert!(seconds(bad).is_err(), "{bad}");
        }
        assert!(positive_seconds("0").is_err());
    }
}
