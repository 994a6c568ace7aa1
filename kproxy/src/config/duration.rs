//! Go `time.Duration` text, as kube-proxy's flags and `metav1.Duration` config fields use it.
//!
//! Parsing follows Go's `time.ParseDuration`: an optional sign, then one or more
//! `<decimal number><unit>` terms with units `ns`, `us`/`µs`/`μs`, `ms`, `s`, `m`, `h`
//! (`1h2m3.5s`, `500ms`, `-1s`); a bare `0` is allowed. Formatting follows Go's
//! `Duration.String` (`30s`, `1m0s`, `24h0m0s`, `500ms`, `0s`), so a written config reads like
//! one written by kube-proxy.
//!
//! Durations are signed here (nanoseconds in an `i64`, like Go) so that a negative value in a
//! file or flag reaches validation and is rejected there with the field's name.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A signed duration in nanoseconds (Go's `time.Duration`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GoDuration(pub i64);

const NS: i64 = 1;
const US: i64 = 1_000;
const MS: i64 = 1_000_000;
const SEC: i64 = 1_000_000_000;
const MIN: i64 = 60 * SEC;
const HOUR: i64 = 60 * MIN;

impl GoDuration {
    pub(crate) const ZERO: GoDuration = GoDuration(0);

    pub(crate) fn from_secs(s: i64) -> Self {
        GoDuration(s * SEC)
    }

    pub fn from_millis(ms: i64) -> Self {
        GoDuration(ms * MS)
    }

    pub(crate) fn is_negative(self) -> bool {
        self.0 < 0
    }

    pub(crate) fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// The duration as a `std::time::Duration` (negative values clamp to zero; validation
    /// rejects them before this is used).
    pub(crate) fn to_std(self) -> Duration {
        Duration::from_nanos(self.0.max(0) as u64)
    }

    /// Parses Go duration text.
    pub fn parse(text: &str) -> Result<GoDuration, DurationError> {
        let err = || DurationError(text.to_owned());
        let mut s = text;
        let mut negative = false;
        if let Some(rest) = s.strip_prefix('-') {
            negative = true;
            s = rest;
        } else if let Some(rest) = s.strip_prefix('+') {
            s = rest;
        }
        if s == "0" {
            return Ok(GoDuration::ZERO);
        }
        if s.is_empty() {
            return Err(err());
        }
        let mut total: i128 = 0;
        while !s.is_empty() {
            // Number: digits, optionally '.' and more digits; at least one digit overall.
            let int_len = s.bytes().take_while(u8::is_ascii_digit).count();
            let (int_part, rest) = s.split_at(int_len);
            let (frac_part, rest) = match rest.strip_prefix('.') {
                Some(r) => {
                    let n = r.bytes().take_while(u8::is_ascii_digit).count();
                    r.split_at(n)
                }
                None => ("", rest),
            };
            if int_part.is_empty() && frac_part.is_empty() {
                return Err(err());
            }
            let unit_len = rest
                .char_indices()
                .find(|(_, c)| *c == '.' || c.is_ascii_digit())
                .map_or(rest.len(), |(i, _)| i);
            let (unit, rest) = rest.split_at(unit_len);
            let scale: i64 = match unit {
                "ns" => NS,
                "us" | "µs" | "μs" => US,
                "ms" => MS,
                "s" => SEC,
                "m" => MIN,
                "h" => HOUR,
                _ => return Err(err()),
            };
            let int: i128 = if int_part.is_empty() {
                0
            } else {
                int_part.parse().map_err(|_| err())?
            };
            let mut value = int.checked_mul(i128::from(scale)).ok_or_else(err)?;
            if !frac_part.is_empty() {
                // Fractional digits beyond nanosecond precision are truncated, as in Go.
                let mut frac: i128 = 0;
                let mut denom: i128 = 1;
                for d in frac_part.bytes().take(18) {
                    frac = frac * 10 + i128::from(d - b'0');
                    denom *= 10;
                }
                value += frac * i128::from(scale) / denom;
            }
            total = total.checked_add(value).ok_or_else(err)?;
            if total > i128::from(i64::MAX) {
                return Err(err());
            }
            s = rest;
        }
        let total = i64::try_from(total).map_err(|_| err())?;
        Ok(GoDuration(if negative { -total } else { total }))
    }
}

impl From<Duration> for GoDuration {
    fn from(d: Duration) -> Self {
        GoDuration(i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
    }
}

/// Bad duration text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid duration {0:?} (Go syntax expected, e.g. \"30s\", \"1m0s\", \"500ms\", \"2h45m\")"
)]
pub struct DurationError(pub String);

impl fmt::Display for GoDuration {
    /// Go's `Duration.String`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let neg = self.0 < 0;
        let u = self.0.unsigned_abs();
        let sign = if neg { "-" } else { "" };
        if u == 0 {
            return f.write_str("0s");
        }
        if u < SEC as u64 {
            let (scale, unit) = if u < US as u64 {
                (1u64, "ns")
            } else if u < MS as u64 {
                (US as u64, "µs")
            } else {
                (MS as u64, "ms")
            };
            return write!(f, "{sign}{}{unit}", frac(u, scale));
        }
        let hours = u / HOUR as u64;
        let rem = u % HOUR as u64;
        let mins = rem / MIN as u64;
        let secs_ns = rem % MIN as u64;
        let secs = frac(secs_ns, SEC as u64);
        if hours > 0 {
            write!(f, "{sign}{hours}h{mins}m{secs}s")
        } else if mins > 0 {
            write!(f, "{sign}{mins}m{secs}s")
        } else {
            write!(f, "{sign}{secs}s")
        }
    }
}

/// `v / scale` with the fraction's trailing zeros removed (`1.5`, `2`).
fn frac(v: u64, scale: u64) -> String {
    let whole = v / scale;
    let rest = v % scale;
    if rest == 0 {
        return whole.to_string();
    }
    let width = scale.to_string().len() - 1;
    let digits = format!("{rest:0width$}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

impl Serialize for GoDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    /// `metav1.Duration` accepts only a string.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        GoDuration::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_syntax() {
        let cases: &[(&str, i64)] = &[
            ("0", 0),
            ("0s", 0),
            ("30s", 30 * SEC),
            ("1m0s", MIN),
            ("1m", MIN),
            ("500ms", 500 * MS),
            ("1.5s", 1500 * MS),
            ("2h45m", 2 * HOUR + 45 * MIN),
            ("24h0m0s", 24 * HOUR),
            ("-1s", -SEC),
            ("+5s", 5 * SEC),
            ("1h2m3.5s", HOUR + 2 * MIN + 3500 * MS),
            ("10us", 10 * US),
            ("10µs", 10 * US),
            ("7ns", 7),
            (".5s", 500 * MS),
            ("1.s", SEC),
        ];
        for (text, want) in cases {
            assert_eq!(GoDuration::parse(text), Ok(GoDuration(*want)), "{text}");
        }
    }

    #[test]
    fn rejects_bad_text() {
        for text in [
            "",
            "-",
            "30",
            "5x",
            "s",
            "1.2.3s",
            "1h-2m",
            " 1s",
            "1s ",
            ".s",
            "9999999999999h",
        ] {
            assert!(GoDuration::parse(text).is_err(), "{text:?} should fail");
        }
    }

    #[test]
    fn formats_like_go() {
        let cases: &[(i64, &str)] = &[
            (0, "0s"),
            (30 * SEC, "30s"),
            (MIN, "1m0s"),
            (15 * MIN, "15m0s"),
            (24 * HOUR, "24h0m0s"),
            (HOUR + 2 * MIN + 3500 * MS, "1h2m3.5s"),
            (500 * MS, "500ms"),
            (1500 * US, "1.5ms"),
            (10 * US, "10µs"),
            (7, "7ns"),
            (-SEC, "-1s"),
        ];
        for (ns, want) in cases {
            assert_eq!(GoDuration(*ns).to_string(), *want);
            assert_eq!(
                GoDuration::parse(want),
                Ok(GoDuration(*ns)),
                "round trip {want}"
            );
        }
    }
}
