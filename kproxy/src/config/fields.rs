//! Which `KubeProxyConfiguration` fields kproxy acts on: the one table the user guide's
//! configuration reference (`cli::reference`) reads, kept honest by tests against the
//! warnings [`super::resolve`] emits and the flag table.
//!
//! The list of fields itself is not kept here: it comes from the serde types in
//! [`super::file`] (see [`field_names`]), so a field added there appears in the reference.

use super::file::KubeProxyConfiguration;

/// What kproxy does with one field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FieldSupport {
    /// Read and acted on.
    Implemented,
    /// Accepted and validated, but without effect (a warning when it differs from its
    /// default); the text says why.
    Ignored(&'static str),
    /// Removed from upstream's v1alpha1; accepted with a warning so old files still load.
    Removed,
}

/// Fields (or whole sections, by prefix) kproxy accepts without acting on them, with why.
pub(crate) const NOT_IMPLEMENTED: &[(&str, &str)] = &[
    (
        "clientConnection.acceptContentTypes",
        "the API client always speaks JSON",
    ),
    (
        "clientConnection.contentType",
        "the API client always speaks JSON",
    ),
    ("clientConnection.qps", "the API client has no rate limiter"),
    (
        "clientConnection.burst",
        "the API client has no rate limiter",
    ),
    ("bindAddressHardFail", "not implemented"),
    ("enableProfiling", "kproxy has no pprof"),
    ("showHiddenMetricsForVersion", "kproxy hides no metrics"),
    (
        "configSyncPeriod",
        "the watchers do not resync periodically",
    ),
    ("portRange", "the userspace proxy's setting"),
    ("logging.flushFrequency", "klog's buffering"),
    ("logging.vmodule", "klog's per-file verbosity"),
    ("logging.options", "klog's stream splitting and buffers"),
    ("winkernel", "Windows only"),
    ("windowsRunAsService", "Windows only"),
];

/// Fields upstream removed from v1alpha1 that kproxy still accepts (with a warning).
pub(crate) const REMOVED: &[&str] = &["udpIdleTimeout", "resourceContainer"];

/// kproxy's additions to the file (not in upstream's v1alpha1), by prefix.
pub(crate) const EXTENSIONS: &[&str] = &["syncPeriod", "minSyncPeriod", "bpf", "serviceCIDRs"];

/// Whether `path` (`iptables.masqueradeBit`) is `prefix` or inside it.
fn under(path: &str, prefix: &str) -> bool {
    path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('.'))
}

/// What kproxy does with the field at `path`.
pub(crate) fn support(path: &str) -> FieldSupport {
    if REMOVED.iter().any(|r| under(path, r)) {
        return FieldSupport::Removed;
    }
    match NOT_IMPLEMENTED.iter().find(|(p, _)| under(path, p)) {
        Some((_, why)) => FieldSupport::Ignored(why),
        None => FieldSupport::Implemented,
    }
}

/// Whether `path` is one of kproxy's extensions to the file.
pub(crate) fn is_extension(path: &str) -> bool {
    EXTENSIONS.iter().any(|e| under(path, e))
}

/// Every field path of the file format, in declaration order (`iptables.masqueradeBit`),
/// sections included (`iptables`), read from the serde types themselves: strict decoding of
/// an unknown key lists the fields a struct expects. A field whose value is itself a struct
/// is probed the same way; maps, lists and scalars are leaves.
pub(crate) fn field_names() -> Vec<String> {
    let mut out = Vec::new();
    probe(&mut out, &[]);
    out
}

/// The key no struct has.
const PROBE_KEY: &str = "kproxyFieldProbe";

fn probe(out: &mut Vec<String>, section: &[String]) {
    let Some(fields) = expected_fields(section) else {
        return;
    };
    for field in fields {
        let mut path = section.to_vec();
        path.push(field);
        out.push(path.join("."));
        if !matches!(path.as_slice(), [one] if one == "apiVersion" || one == "kind") {
            probe(out, &path);
        }
    }
}

/// The fields of the struct at `section` (empty: the document), or None when the value
/// there is not a struct.
fn expected_fields(section: &[String]) -> Option<Vec<String>> {
    let mut yaml = format!(
        "apiVersion: {}\nkind: {}\n",
        super::file::API_VERSION,
        super::file::KIND
    );
    let mut indent = String::new();
    for (i, key) in section.iter().enumerate() {
        if i == 0 && (key == "apiVersion" || key == "kind") {
            return None;
        }
        yaml.push_str(&format!("{indent}{key}:\n"));
        indent.push_str("  ");
    }
    yaml.push_str(&format!("{indent}{PROBE_KEY}: 1\n"));
    let err = serde_yaml::from_str::<KubeProxyConfiguration>(&yaml).err()?;
    let msg = err.to_string();
    let (_, expected) = msg.split_once(&format!("unknown field `{PROBE_KEY}`, expected"))?;
    Some(
        expected
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_names_come_from_the_serde_types() {
        let names = field_names();
        for expected in [
            "apiVersion",
            "mode",
            "iptables",
            "iptables.masqueradeBit",
            "ipvs.excludeCIDRs",
            "logging.options.text.splitStream",
            "bpf.conntrack.expiryInterval",
            "bpf.mapSizes",
            "udpIdleTimeout",
        ] {
            assert!(names.iter().any(|n| n == expected), "{expected}: {names:?}");
        }
        // Maps and lists are leaves, not probed into.
        assert!(!names.iter().any(|n| n.starts_with("bpf.mapSizes.")));
        assert!(!names.iter().any(|n| n.starts_with("featureGates.")));
    }

    /// The paths `resolve` passes to its "accepted but not implemented" warning.
    fn warned_paths() -> Vec<String> {
        let source = include_str!("resolve.rs");
        let mut paths = Vec::new();
        for part in source.split("cx.ignored(").skip(1) {
            let part = part.trim_start();
            let Some(rest) = part.strip_prefix('"') else {
                continue;
            };
            if let Some((path, _)) = rest.split_once('"') {
                paths.push(path.to_owned());
            }
        }
        paths
    }

    #[test]
    fn every_field_resolve_warns_about_is_listed_as_not_implemented() {
        let warned = warned_paths();
        assert!(warned.len() >= 10, "parsed too few paths: {warned:?}");
        for path in &warned {
            assert!(
                matches!(support(path), FieldSupport::Ignored(_)),
                "resolve warns that {path} is not implemented, but NOT_IMPLEMENTED lacks it"
            );
        }
    }

    #[test]
    fn listed_fields_exist_in_the_file_format() {
        let names = field_names();
        for path in NOT_IMPLEMENTED
            .iter()
            .map(|(p, _)| *p)
            .chain(REMOVED.iter().copied())
            .chain(EXTENSIONS.iter().copied())
        {
            assert!(names.iter().any(|n| n == path), "{path} is not a field");
        }
    }

    #[test]
    fn removed_fields_are_the_ones_resolve_warns_about() {
        let source = include_str!("resolve.rs");
        for field in REMOVED {
            assert!(source.contains(&format!("(\"{field}\"")), "{field}");
            assert_eq!(support(field), FieldSupport::Removed);
        }
    }

    #[test]
    fn prefixes_match_whole_segments() {
        assert!(matches!(
            support("winkernel.enableDSR"),
            FieldSupport::Ignored(_)
        ));
        assert_eq!(support("iptables.masqueradeBit"), FieldSupport::Implemented);
        assert!(is_extension("bpf.conntrack.expiryInterval"));
        assert!(is_extension("syncPeriod"));
        assert!(!is_extension("configSyncPeriod"));
        assert!(!is_extension("iptables.syncPeriod"));
    }
}
