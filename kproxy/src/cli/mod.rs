//! The command line: kube-proxy's flags (Go pflag syntax), kproxy's commands, and loading the
//! resolved configuration from file + flags.
//!
//! ```text
//! kproxy [FLAGS]                      run the agent
//! kproxy render --manifests PATH …    print the snapshot a mode would program (no kernel)
//! kproxy cleanup [FLAGS]              (= --cleanup) remove what any mode left, exit 0
//! ```
//!
//! Syntax is pflag's, so any kube-proxy command line parses: `--flag=value`, `--flag value`,
//! booleans as `--flag` or `--flag=false`, `-v=2` / `-v 2` / `-v2`, a repeated flag's last
//! value wins (list flags append), `_` in a flag name reads as `-` (upstream normalizes
//! `--log_dir` to `--log-dir`). The flag table is `flags::FLAGS`; unknown flags are errors.
//!
//! [`load`] reads `--config` (strict), applies upstream's defaults, then every flag actually
//! given (so flags override the file), and resolves the result into a
//! [`ProxyConfig`].

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Arg, ArgAction};

use crate::config::file::{LoadError, append_port_if_needed};
use crate::config::resolve::Extra;
use crate::config::{ConfigErrors, GoDuration, KubeProxyConfiguration, ProxyConfig, resolve};

pub mod flags;
pub mod reference;
pub mod render;

use flags::{Apply, FLAGS, FlagSpec, Kind, Support};

/// What to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Run the agent (default).
    Agent,
    /// `kproxy render`: print what would be programmed.
    Render,
    /// `kproxy cleanup` or `--cleanup`.
    Cleanup,
    /// `kproxy inspect`: what the kernel holds per service port.
    Inspect,
}

/// `--version` forms (component-base's verflag).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionRequest {
    /// `--version` / `--version=true`.
    Print,
    /// `--version=raw`.
    Raw,
}

/// `render --output`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenderOutput {
    Json,
    Table,
    /// The datapath's planned kernel state (`render --proxy-mode X` without `--output`).
    Plan,
}

/// One flag as given: its spec and every value in command-line order.
#[derive(Debug, Clone)]
pub struct Given {
    pub spec: &'static FlagSpec,
    pub values: Vec<String>,
}

impl Given {
    /// The last value (pflag: the last occurrence wins).
    pub(crate) fn last(&self) -> &str {
        self.values.last().map_or("", String::as_str)
    }
}

/// A parsed command line.
#[derive(Debug, Clone)]
pub struct Invocation {
    pub command: Command,
    /// The flags given, in `FLAGS` order.
    pub given: Vec<Given>,
}

/// A bad command line or configuration. `Display` is the message for stderr.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// pflag's wording: `invalid argument "5x" for "--iptables-sync-period" flag: …`.
    #[error("invalid argument {value:?} for \"--{flag}\" flag: {reason}")]
    Flag {
        flag: &'static str,
        value: String,
        reason: String,
    },
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Invalid(#[from] ConfigErrors),
}

/// Everything `main` needs after loading.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub command: Command,
    /// The effective v1alpha1 configuration (what `--write-config-to` writes).
    pub effective: KubeProxyConfiguration,
    pub config: ProxyConfig,
    /// Accepted-but-ignored flags and fields, one line each (log them once logging is up).
    pub warnings: Vec<String>,
    pub write_config_to: Option<PathBuf>,
    pub init_only: bool,
    pub output: RenderOutput,
    /// `kproxy inspect --service namespace/name`.
    pub service: Option<String>,
}

/// The clap command for the flag table.
fn clap_command() -> clap::Command {
    let mut cmd = clap::Command::new("kproxy")
        .about("A drop-in replacement for Kubernetes' kube-proxy (eBPF, IPVS or iptables datapath)")
        .disable_version_flag(true)
        .arg(
            Arg::new("COMMAND")
                .value_parser(["render", "cleanup", "inspect"])
                .help("render: print the snapshot a mode would program (no kernel changes); cleanup: same as --cleanup. Default: run the agent."),
        );
    for f in FLAGS {
        let mut a = Arg::new(f.name)
            .long(f.name)
            .help(f.help)
            .action(ArgAction::Append)
            .allow_hyphen_values(true);
        if let Some(s) = f.short {
            a = a.short(s);
        }
        a = match f.kind {
            Kind::Bool => a
                .num_args(0..=1)
                .require_equals(true)
                .default_missing_value("true")
                .value_name("BOOL"),
            Kind::Value(ph) if f.name == "version" => a
                .num_args(0..=1)
                .require_equals(true)
                .default_missing_value("true")
                .value_name(ph),
            Kind::Value(ph) => a.num_args(1).value_name(ph),
        };
        cmd = cmd.arg(a);
    }
    cmd
}

/// `--log_dir=x` ⇒ `--log-dir=x` (upstream's `WordSepNormalizeFunc`); values are untouched.
fn normalize(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut rest = false;
    for a in args {
        let Some(s) = a.to_str() else {
            out.push(a);
            continue;
        };
        if rest || !s.starts_with("--") || s == "--" {
            rest |= s == "--";
            out.push(a);
            continue;
        }
        let (name, value) = match s.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (s, None),
        };
        let name = name.replace('_', "-");
        out.push(match value {
            Some(v) => format!("{name}={v}").into(),
            None => name.into(),
        });
    }
    out
}

/// Parses a command line (`args[0]` is the program name). Help and usage errors come back as
/// `clap::Error` (`.exit()` prints them with the right exit code).
pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Invocation, clap::Error> {
    let m = clap_command().try_get_matches_from(normalize(args))?;
    let command = match m.get_one::<String>("COMMAND").map(String::as_str) {
        Some("render") => Command::Render,
        Some("cleanup") => Command::Cleanup,
        Some("inspect") => Command::Inspect,
        _ => Command::Agent,
    };
    let given = FLAGS
        .iter()
        .filter_map(|spec| {
            let values: Vec<String> = m.get_many::<String>(spec.name)?.cloned().collect();
            Some(Given { spec, values })
        })
        .collect();
    Ok(Invocation { command, given })
}

impl Invocation {
    pub(crate) fn get(&self, name: &str) -> Option<&Given> {
        self.given.iter().find(|g| g.spec.name == name)
    }

    fn flag_bool(&self, name: &'static str) -> Result<bool, CliError> {
        self.get(name)
            .map_or(Ok(false), |g| parse_bool(name, g.last()))
    }

    /// `--version` as given (`None` when absent or `--version=false`).
    pub fn version(&self) -> Result<Option<VersionRequest>, CliError> {
        let Some(g) = self.get("version") else {
            return Ok(None);
        };
        match g.last() {
            "raw" => Ok(Some(VersionRequest::Raw)),
            v => Ok(parse_bool("version", v)?.then_some(VersionRequest::Print)),
        }
    }
}

/// Go's `strconv.ParseBool`.
fn parse_bool(flag: &'static str, v: &str) -> Result<bool, CliError> {
    match v {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        _ => Err(flag_err(flag, v, "expected true or false")),
    }
}

fn flag_err(flag: &'static str, value: &str, reason: impl Into<String>) -> CliError {
    CliError::Flag {
        flag,
        value: value.to_owned(),
        reason: reason.into(),
    }
}

/// Go's `strconv.ParseInt(s, 0, 32)`: decimal, `0x…`, `0o…`/`0…` (octal), `0b…`.
fn parse_i32(flag: &'static str, v: &str) -> Result<i32, CliError> {
    let (neg, body) = match v.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, v.strip_prefix('+').unwrap_or(v)),
    };
    let lower = body.to_ascii_lowercase();
    let (radix, digits) = if let Some(d) = lower.strip_prefix("0x") {
        (16, d.to_owned())
    } else if let Some(d) = lower.strip_prefix("0b") {
        (2, d.to_owned())
    } else if let Some(d) = lower.strip_prefix("0o") {
        (8, d.to_owned())
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, lower[1..].to_owned())
    } else {
        (10, lower)
    };
    let parsed = if digits.is_empty() || digits.starts_with(['+', '-']) {
        None
    } else {
        i64::from_str_radix(&digits, radix).ok()
    };
    parsed
        .map(|n| if neg { -n } else { n })
        .and_then(|n| i32::try_from(n).ok())
        .ok_or_else(|| flag_err(flag, v, "expected a 32-bit integer"))
}

fn parse_duration(flag: &'static str, v: &str) -> Result<GoDuration, CliError> {
    GoDuration::parse(v).map_err(|e| flag_err(flag, v, e.to_string()))
}

/// pflag's string slice: comma-separated; an empty value is an empty list.
fn split_list(v: &str) -> Vec<String> {
    if v.is_empty() {
        Vec::new()
    } else {
        v.split(',').map(|s| s.trim().to_owned()).collect()
    }
}

/// `key=value,…` pairs.
fn pairs<'a>(flag: &'static str, v: &'a str) -> Result<Vec<(&'a str, &'a str)>, CliError> {
    v.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| flag_err(flag, v, format!("{kv:?} is not KEY=VALUE")))
        })
        .collect()
}

/// Sets `addr`'s port (keeping its host); port 0 disables the server (empty address).
fn with_port(
    addr: &Option<String>,
    port: i32,
    flag: &'static str,
    raw: &str,
) -> Result<String, CliError> {
    if port == 0 {
        return Ok(String::new());
    }
    let port = u16::try_from(port).map_err(|_| flag_err(flag, raw, "expected a port (0-65535)"))?;
    let host = addr
        .as_deref()
        .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
        .map_or_else(|| "0.0.0.0".to_owned(), |sa| sa.ip().to_string());
    Ok(append_port_if_needed(&host, port))
}

/// Applies every given flag to `cfg` (already defaulted) and `extra`, each as its
/// [`FlagSpec::apply`] says; collects warnings for ignored and removed flags.
pub(crate) fn apply_flags(
    cfg: &mut KubeProxyConfiguration,
    inv: &Invocation,
    extra: &mut Extra,
    warnings: &mut Vec<String>,
) -> Result<(), CliError> {
    for g in &inv.given {
        let name = g.spec.name;
        let v = g.last();
        if let Some(field) = g.spec.field {
            extra.flag_of.insert(field.to_owned(), format!("--{name}"));
        }
        match g.spec.support {
            Support::Implemented => {}
            Support::Ignored => warnings.push(format!(
                "flag --{name} is accepted but not implemented by kproxy; ignored"
            )),
            Support::Removed => warnings.push(format!(
                "flag --{name} was removed from kube-proxy; accepted and ignored"
            )),
        }
        match g.spec.apply {
            Apply::Nothing => {
                if g.spec.kind == Kind::Bool {
                    parse_bool(name, v)?;
                }
            }
            Apply::Str(field) => *field(cfg) = Some(v.to_owned()),
            Apply::Bool(field) => *field(cfg) = Some(parse_bool(name, v)?),
            Apply::I32(field) => *field(cfg) = Some(parse_i32(name, v)?),
            Apply::Duration(field) => *field(cfg) = Some(parse_duration(name, v)?),
            Apply::List(field) => {
                *field(cfg) = Some(g.values.iter().flat_map(|v| split_list(v)).collect());
            }
            Apply::Custom(set) => set(cfg, extra, g)?,
        }
    }
    Ok(())
}

// The flags with their own parsing ([`Apply::Custom`]).

fn set_master(
    _: &mut KubeProxyConfiguration,
    extra: &mut Extra,
    g: &Given,
) -> Result<(), CliError> {
    extra.master = Some(g.last().to_owned());
    Ok(())
}

fn set_manifests(
    _: &mut KubeProxyConfiguration,
    extra: &mut Extra,
    g: &Given,
) -> Result<(), CliError> {
    extra.manifests = Some(PathBuf::from(g.last()));
    Ok(())
}

fn set_hostname_override(
    cfg: &mut KubeProxyConfiguration,
    _: &mut Extra,
    g: &Given,
) -> Result<(), CliError> {
    let v = g.last();
    if !v.is_empty() {
        let h = v.trim();
        if h.is_empty() {
            return Err(CliError::Usage("empty hostname-override is invalid".into()));
        }
        cfg.hostname_override = Some(h.to_lowercase());
    }
    Ok(())
}

fn set_healthz_bind_address(
    cfg: &mut KubeProxyConfiguration,
    _: &mut Extra,
    g: &Given,
) -> Result<(), CliError> {
    cfg.healthz_bind_address = Some(append_port_if_needed(
        g.last(),
        crate::config::file::defaults::HEALTHZ_PORT,
    ));
    Ok(())
}

fn set_metrics_bind_address(
    cfg: &mut KubeProxyConfiguration,
    _: &mut Extra,
    g: &Given,
) -> Result<(), CliError> {
    cfg.metrics_bind_address = Some(append_port_if_needed(
        g.last(),
        crate::config::file::defaults::METRICS_PORT,
    ));
    Ok(())
}

fn set_healthz_port(
    cfg: &mut KubeProxyConfiguration,
    _: &mut Extra,
    g: &Given,
) -> Result<(), CliError> {
    let (name, v) = (g.spec.name, g.last());
    let p = parse_i32(name, v)?;
    cfg.healthz_bind_address = Some(with_port(&cfg.healthz_bind_address, p, name, v)?);
    Ok(())
}

fn set_metrics_port(
    cfg: &mut KubeProxyConfiguration,
    _: &mut Extra,
    g: &Given,
) -> Result<(), CliError> {
    let (name, v) = (g.spec.name, g.last());
    let p = parse_i32(name, v)?;
    cfg.metrics_bind_address = Some(with_port(&cfg.metrics_bind_address, p, name, v)?);
    Ok(())
}

fn set_feature_gates(
    cfg: &mut KubeProxyConfiguration,
    _: &mut Extra,
    g: &Given,
) -> Result<(), CliError> {
    let name = g.spec.name;
    let gates = cfg.feature_gates.get_or_insert_with(BTreeMap::new);
    for raw in &g.values {
        for (k, b) in pairs(name, raw)? {
            gates.insert(k.to_owned(), parse_bool(name, b)?);
        }
    }
    Ok(())
}

fn set_kube_api_qps(
    cfg: &mut KubeProxyConfiguration,
    _: &mut Extra,
    g: &Given,
) -> Result<(), CliError> {
    let (name, v) = (g.spec.name, g.last());
    let q: f32 = v
        .parse()
        .map_err(|_| flag_err(name, v, "expected a number"))?;
    cfg.client_connection.qps = Some(q);
    Ok(())
}

fn set_verbosity(
    cfg: &mut KubeProxyConfiguration,
    _: &mut Extra,
    g: &Given,
) -> Result<(), CliError> {
    let (name, v) = (g.spec.name, g.last());
    let n: u32 = v
        .parse()
        .map_err(|_| flag_err(name, v, "expected a non-negative integer"))?;
    cfg.logging.verbosity = Some(n);
    Ok(())
}

fn set_bpf_map_sizes(
    cfg: &mut KubeProxyConfiguration,
    _: &mut Extra,
    g: &Given,
) -> Result<(), CliError> {
    let name = g.spec.name;
    let sizes = cfg.bpf.map_sizes.get_or_insert_with(BTreeMap::new);
    for raw in &g.values {
        for (k, n) in pairs(name, raw)? {
            let n: u32 = n.parse().map_err(|_| {
                flag_err(
                    name,
                    raw,
                    format!("size of {k:?} must be a positive integer"),
                )
            })?;
            sizes.insert(k.to_owned(), n);
        }
    }
    Ok(())
}

fn set_maglev_table_size(
    cfg: &mut KubeProxyConfiguration,
    _: &mut Extra,
    g: &Given,
) -> Result<(), CliError> {
    let (name, v) = (g.spec.name, g.last());
    let n: u32 = v
        .parse()
        .map_err(|_| flag_err(name, v, "expected a positive integer (a prime)"))?;
    cfg.bpf.maglev_table_size = Some(n);
    Ok(())
}

/// Reads `--config`, applies defaults and flags, resolves. `hostname` overrides the kernel's
/// hostname (tests).
pub fn load(inv: &Invocation, hostname: Option<String>) -> Result<Loaded, CliError> {
    let mut cfg = match inv.get("config").map(Given::last).filter(|p| !p.is_empty()) {
        Some(path) => KubeProxyConfiguration::load(std::path::Path::new(path))?,
        None => KubeProxyConfiguration::default(),
    };
    cfg.apply_defaults();
    let mut extra = Extra {
        hostname,
        ..Extra::default()
    };
    let mut warnings = Vec::new();
    apply_flags(&mut cfg, inv, &mut extra, &mut warnings)?;

    let cleanup = inv.flag_bool("cleanup")?;
    let command = match inv.command {
        Command::Agent if cleanup => Command::Cleanup,
        c => c,
    };
    if inv.get("output").is_some() && !matches!(command, Command::Render | Command::Inspect) {
        return Err(CliError::Usage(
            "--output is only valid with `kproxy render` and `kproxy inspect`".into(),
        ));
    }
    let service = inspect_service(inv, command)?;
    let resolved = resolve(&cfg, &extra)?;
    let output = match inv.get("output").map(Given::last) {
        None if command == Command::Inspect => RenderOutput::Table,
        None if matches!(resolved.config.mode, crate::config::ModeChoice::Forced(_)) => {
            RenderOutput::Plan
        }
        None | Some("json") => RenderOutput::Json,
        Some("table") => RenderOutput::Table,
        Some(other) => return Err(flag_err("output", other, "expected json or table")),
    };
    warnings.extend(resolved.warnings);
    Ok(Loaded {
        command,
        effective: cfg,
        config: resolved.config,
        warnings,
        write_config_to: inv
            .get("write-config-to")
            .map(|g| PathBuf::from(g.last()))
            .filter(|p| !p.as_os_str().is_empty()),
        init_only: inv.flag_bool("init-only")?,
        output,
        service,
    })
}

/// `--service namespace/name` (inspect only).
fn inspect_service(inv: &Invocation, command: Command) -> Result<Option<String>, CliError> {
    let Some(v) = inv.get("service").map(Given::last) else {
        return Ok(None);
    };
    if command != Command::Inspect {
        return Err(CliError::Usage(
            "--service is only valid with `kproxy inspect`".into(),
        ));
    }
    match v.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok(Some(v.to_string()))
        }
        _ => Err(flag_err("service", v, "expected namespace/name")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ModeChoice, NodePortAddresses};
    use crate::dataplane::ProxyMode;

    fn inv(args: &[&str]) -> Invocation {
        let mut v: Vec<OsString> = vec!["kproxy".into()];
        v.extend(args.iter().map(OsString::from));
        parse(v).unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    fn loaded(args: &[&str]) -> Loaded {
        load(&inv(args), Some("host".into())).unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    fn load_err(args: &[&str]) -> String {
        match load(&inv(args), Some("host".into())) {
            Ok(_) => panic!("{args:?} should fail"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn pflag_syntax_forms() {
        let c = loaded(&[
            "--iptables-sync-period=5s",
            "--ipvs-sync-period",
            "6s",
            "-v=3",
            "--masquerade-all",
        ])
        .config;
        assert_eq!(c.iptables.sync.sync_period.as_secs(), 5);
        assert_eq!(c.ipvs.sync.sync_period.as_secs(), 6);
        assert_eq!(c.logging.verbosity, 3);
        assert!(c.masquerade_all);
        assert_eq!(loaded(&["-v", "4"]).config.logging.verbosity, 4);
        assert_eq!(loaded(&["-v5"]).config.logging.verbosity, 5);
        assert_eq!(loaded(&["--v=2"]).config.logging.verbosity, 2);
        assert!(!loaded(&["--masquerade-all=false"]).config.masquerade_all);
        assert!(loaded(&["--masquerade-all=T"]).config.masquerade_all);
        // Last occurrence wins; underscores normalize; negative values after a space.
        assert_eq!(
            loaded(&["--oom-score-adj", "-500", "--oom_score_adj=-100"])
                .config
                .oom_score_adj,
            -100
        );
        assert_eq!(
            loaded(&["--iptables-masquerade-bit=0x1f"])
                .config
                .masquerade_bit,
            31
        );
    }

    #[test]
    fn bool_flags_do_not_take_a_separate_value() {
        let mut v: Vec<OsString> = vec!["kproxy".into()];
        v.extend(["--masquerade-all", "false"].map(OsString::from));
        assert!(parse(v).is_err());
    }

    #[test]
    fn unknown_flag_is_an_error_naming_it() {
        let e = parse(["kproxy", "--no-such-flag=1"].map(OsString::from)).unwrap_err();
        assert!(e.to_string().contains("--no-such-flag"), "{e}");
    }

    #[test]
    fn bad_flag_values_name_the_flag() {
        assert_eq!(
            load_err(&["--iptables-sync-period=5x"]),
            "invalid argument \"5x\" for \"--iptables-sync-period\" flag: invalid duration \"5x\" (Go syntax expected, e.g. \"30s\", \"1m0s\", \"500ms\", \"2h45m\")"
        );
        assert!(load_err(&["--masquerade-all=yes"]).contains("\"--masquerade-all\" flag"));
        assert!(load_err(&["--oom-score-adj=lots"]).contains("\"--oom-score-adj\" flag"));
        assert!(load_err(&["--feature-gates=Foo"]).contains("\"--feature-gates\" flag"));
        assert!(load_err(&["--bpf-map-sizes=ct=x"]).contains("\"--bpf-map-sizes\" flag"));
        // Values valid as text but invalid for the field: the field and the flag are named.
        let e = load_err(&["--iptables-masquerade-bit=32"]);
        assert!(e.contains("iptables.masqueradeBit (--iptables-masquerade-bit): must be within the range [0, 31]"), "{e}");
        let e = load_err(&["--proxy-mode=userspace"]);
        assert!(
            e.contains("mode (--proxy-mode): \"userspace\" is not a proxy mode"),
            "{e}"
        );
        let e = load_err(&["--nodeport-addresses=10.0.0.0/8,bogus"]);
        assert!(
            e.contains("nodePortAddresses[1] (--nodeport-addresses)"),
            "{e}"
        );
    }

    #[test]
    fn list_flags_split_and_append() {
        let c = loaded(&[
            "--nodeport-addresses=10.0.0.0/8,192.168.0.0/16",
            "--nodeport-addresses",
            "fd00::/8",
        ])
        .config;
        assert_eq!(
            c.node_port_addresses,
            NodePortAddresses::Cidrs(vec![
                "10.0.0.0/8".parse().unwrap(),
                "192.168.0.0/16".parse().unwrap(),
                "fd00::/8".parse().unwrap()
            ])
        );
        let c = loaded(&[
            "--bpf-devices=eth0,eth1",
            "--bpf-map-sizes=ct=1024,services=64",
        ])
        .config;
        assert_eq!(c.bpf.devices, ["eth0", "eth1"]);
        assert_eq!(c.bpf.map_sizes.get("ct"), Some(&1024));
    }

    #[test]
    fn commands_and_modes() {
        assert_eq!(loaded(&[]).command, Command::Agent);
        assert_eq!(loaded(&["--cleanup"]).command, Command::Cleanup);
        assert_eq!(loaded(&["cleanup"]).command, Command::Cleanup);
        let l = loaded(&[
            "render",
            "--proxy-mode",
            "iptables",
            "--manifests",
            "/x",
            "--output=table",
        ]);
        assert_eq!(l.command, Command::Render);
        assert_eq!(l.output, RenderOutput::Table);
        assert_eq!(l.config.mode, ModeChoice::Forced(ProxyMode::Iptables));
        assert_eq!(loaded(&["--proxy-mode="]).config.mode, ModeChoice::Detect);
        assert!(load_err(&["--output=table"]).contains("only valid with `kproxy render`"));
        assert_eq!(loaded(&["inspect"]).command, Command::Inspect);
    }

    #[test]
    fn ignored_and_removed_flags_warn_once_naming_the_flag() {
        let l = loaded(&[
            "--profiling",
            "--logtostderr",
            "--log-dir=/tmp",
            "--feature-gates=A=true",
            "--kube-api-qps=20",
        ]);
        for flag in [
            "--profiling",
            "--logtostderr",
            "--log-dir",
            "--feature-gates",
            "--kube-api-qps",
        ] {
            let n = l
                .warnings
                .iter()
                .filter(|w| w.contains(&format!("{flag} ")))
                .count();
            assert_eq!(n, 1, "{flag}: {:?}", l.warnings);
        }
        assert_eq!(l.warnings.len(), 5, "{:?}", l.warnings);
    }

    #[test]
    fn healthz_and_metrics_ports() {
        let c = loaded(&["--healthz-bind-address=127.0.0.1", "--metrics-port=0"]).config;
        assert_eq!(
            c.healthz_bind_address,
            Some("127.0.0.1:10256".parse().unwrap())
        );
        assert_eq!(c.metrics_bind_address, None);
        let c = loaded(&["--healthz-port=9999", "--healthz-bind-address="]).config;
        assert_eq!(
            c.healthz_bind_address,
            Some("0.0.0.0:9999".parse().unwrap())
        );
        let c = loaded(&["--healthz-bind-address="]).config;
        assert_eq!(c.healthz_bind_address, None);
    }

    #[test]
    fn hostname_override() {
        assert_eq!(
            loaded(&["--hostname-override=Node-7"]).config.node_name,
            "node-7"
        );
        assert_eq!(loaded(&[]).config.node_name, "host");
        assert_eq!(
            load_err(&["--hostname-override=  "]),
            "empty hostname-override is invalid"
        );
    }

    #[test]
    fn version_forms() {
        assert_eq!(
            inv(&["--version"]).version().unwrap(),
            Some(VersionRequest::Print)
        );
        assert_eq!(
            inv(&["--version=raw"]).version().unwrap(),
            Some(VersionRequest::Raw)
        );
        assert_eq!(inv(&["--version=false"]).version().unwrap(), None);
        assert_eq!(inv(&[]).version().unwrap(), None);
    }

    #[test]
    fn go_ints() {
        for (s, n) in [
            ("10", 10),
            ("-10", -10),
            ("0x10", 16),
            ("010", 8),
            ("0o10", 8),
            ("0b11", 3),
            ("0", 0),
        ] {
            assert_eq!(parse_i32("x", s).unwrap(), n, "{s}");
        }
        for s in ["", "x", "0x", "99999999999", "1.5", "--1"] {
            assert!(parse_i32("x", s).is_err(), "{s}");
        }
    }
}
