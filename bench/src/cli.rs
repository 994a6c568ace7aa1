//! `kp-bench`'s command line (the binary is `src/bin/kp-bench.rs`; `cargo xtask bench` runs
//! it).

use std::path::PathBuf;

use clap::Parser;

/// The groups `--only` chooses from, in run order (`inspect` and `soak` run in a full run or
/// when named).
pub const GROUPS: [&str; 8] = [
    "packet",
    "connect",
    "control",
    "maglev",
    "throughput",
    "resync",
    "inspect",
    "soak",
];

/// Runs kproxy's benchmarks and writes the report (REPORT.md, results.json, SVG plots).
/// Needs root. `cargo xtask bench` builds everything in release mode and runs this.
#[derive(Debug, Clone, PartialEq, Parser)]
#[command(name = "kp-bench")]
pub struct Args {
    /// The quick plan (under 3 minutes; without `inspect` and `soak` unless --only names them).
    #[arg(long)]
    pub quick: bool,
    /// Where the report goes.
    #[arg(long, value_name = "DIR", default_value = "bench")]
    pub out: PathBuf,
    /// Only these groups (comma-separated).
    #[arg(long, value_name = "GROUP,…", value_delimiter = ',', value_parser = GROUPS)]
    pub only: Option<Vec<String>>,
    /// The commit the report names (default: `git rev-parse HEAD`).
    #[arg(long, value_name = "SHA")]
    pub commit: Option<String>,
    /// Inside the QEMU guest: the connect and control groups for ipvs, the results JSON
    /// printed on stdout between the guest markers.
    #[arg(long, conflicts_with = "merge_guest")]
    pub in_guest: bool,
    /// On the host: merge a guest run (FILE: the guest's output) into DIR's results.json and
    /// rewrite the report.
    #[arg(long, value_name = "FILE")]
    pub merge_guest: Option<PathBuf>,
    /// With --merge-guest: the guest's accelerator (`kvm`, `tcg`).
    #[arg(long, requires = "merge_guest", default_value = "unknown")]
    pub accel: String,
    /// With --merge-guest: the guest run's wall seconds.
    #[arg(
        long,
        value_name = "S",
        requires = "merge_guest",
        default_value_t = 0.0
    )]
    pub guest_seconds: f64,
}

impl Args {
    /// Whether group `g` runs (every group without --only).
    pub fn wanted(&self, g: &str) -> bool {
        self.only.as_ref().is_none_or(|o| o.iter().any(|x| x == g))
    }

    /// Whether --only names group `g`.
    pub fn named(&self, g: &str) -> bool {
        self.only.as_ref().is_some_and(|o| o.iter().any(|x| x == g))
    }

    /// --only as given, comma-separated (the report's note).
    pub fn only_text(&self) -> Option<String> {
        self.only.as_ref().map(|o| o.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("kp-bench").chain(args.iter().copied()))
    }

    #[test]
    fn command_line_is_consistent_and_help_answers() {
        Args::command().debug_assert();
        let help = parse(&["--help"]).unwrap_err();
        assert_eq!(help.kind(), clap::error::ErrorKind::DisplayHelp);
        assert!(help.to_string().contains("--merge-guest <FILE>"), "{help}");
    }

    #[test]
    fn every_option_parses_as_before() {
        let a = parse(&[]).unwrap();
        assert_eq!(
            (a.quick, a.out.to_str(), &a.only, &a.commit, a.in_guest),
            (false, Some("bench"), &None, &None, false)
        );
        assert!(a.wanted("soak") && !a.named("soak"));
        let a = parse(&[
            "--quick",
            "--out",
            "/tmp/x",
            "--only",
            "packet,soak",
            "--commit",
            "0123abc",
        ])
        .unwrap();
        assert!(a.quick && a.wanted("packet") && a.named("soak") && !a.wanted("connect"));
        assert_eq!(a.only_text().as_deref(), Some("packet,soak"));
        assert_eq!(
            (a.out.to_str(), a.commit.as_deref()),
            (Some("/tmp/x"), Some("0123abc"))
        );
        assert!(
            parse(&["--in-guest", "--commit", "c", "--only", "control"]).is_ok_and(|a| a.in_guest)
        );
        let m = parse(&[
            "--merge-guest",
            "out.log",
            "--accel",
            "tcg",
            "--guest-seconds",
            "301.5",
            "--out",
            "d",
        ])
        .unwrap();
        assert_eq!(
            (m.merge_guest.as_deref(), m.accel.as_str(), m.guest_seconds),
            (Some(std::path::Path::new("out.log")), "tcg", 301.5)
        );
        // A misspelt group, an unknown option and a lone --accel are errors, not ignored.
        assert!(parse(&["--only", "packets"]).is_err());
        assert!(parse(&["--fast"]).is_err());
        assert!(parse(&["--accel", "tcg"]).is_err());
    }
}
