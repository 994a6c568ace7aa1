//! Running the netfilter tools (`iptables-restore`, `nft`, …), in the caller's network
//! namespace or in another one through `nsenter --net=PATH`.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// `program` in the network namespace `netns` (`None`: the caller's).
pub(crate) fn command(netns: Option<&Path>, program: &str) -> Command {
    match netns {
        Some(ns) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net={}", ns.display())).arg(program);
            c
        }
        None => Command::new(program),
    }
}

/// What a finished tool run printed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Output {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `cmd` with `stdin` piped in (or none) and collects its output. A failed write to its
/// stdin is left for the tool's own exit status to report.
pub(crate) fn run(mut cmd: Command, stdin: Option<&str>) -> std::io::Result<Output> {
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("piped stdin");
        let _ = pipe.write_all(input.as_bytes());
    }
    let out = child.wait_with_output()?;
    Ok(Output {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// The legacy (x_tables) tables of `family` that exist in the calling thread's network
/// namespace (`/proc/thread-self/net/ip_tables_names` / `ip6_tables_names`).
///
/// Naming a table to a legacy binary — `iptables-legacy-save -t nat`, `iptables-legacy -t
/// nat -F X` — loads and creates it, so a mode that merely looks for (or removes) another's
/// leftovers would leave empty `filter`/`nat`/`mangle` tables on a node that had none.
/// Callers ask here first and skip tables that do not exist. An unreadable file (no x_tables
/// in the kernel) means none exists.
pub(crate) fn legacy_tables(family: crate::model::IpFamily) -> Vec<String> {
    let file = match family {
        crate::model::IpFamily::V4 => "ip_tables_names",
        crate::model::IpFamily::V6 => "ip6_tables_names",
    };
    std::fs::read_to_string(Path::new("/proc/thread-self/net").join(file))
        .map(|s| s.lines().map(|l| l.trim().to_string()).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_with_stdin_and_reports_failure() {
        let mut c = command(None, "sh");
        c.args(["-c", "cat; echo err >&2"]);
        let out = run(c, Some("hello")).unwrap();
        assert_eq!(
            (out.success, out.stdout.as_str(), out.stderr.as_str()),
            (true, "hello", "err\n")
        );
        let mut c = command(None, "sh");
        c.args(["-c", "exit 3"]);
        assert!(!run(c, None).unwrap().success);
        assert_eq!(
            format!("{:?}", command(Some(Path::new("/run/netns/x")), "nft")),
            "\"nsenter\" \"--net=/run/netns/x\" \"nft\""
        );
    }
}
