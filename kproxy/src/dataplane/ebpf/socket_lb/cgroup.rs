//! Is `--bpf-cgroup` a place where socket LB covers the node? Checked before the eBPF mode
//! starts (forced: a clear error; detected: the mode is rejected with the reason).
//!
//! Socket LB attaches to one cgroup and covers every process below it. On a node that is the
//! host's cgroup2 hierarchy root (or a cgroup the operator picks on purpose — tests use a
//! dedicated sub-cgroup). Inside a container with a **private cgroup namespace**
//! (`man 7 cgroup_namespaces`; the default for containers on cgroup v2) whose cgroup2 mount is
//! the container's own (`mount -t cgroup2` inside the namespace), `/sys/fs/cgroup` is the
//! container's cgroup: attaching there succeeds, but only the container's own processes are
//! covered — pods would silently bypass socket LB.
//!
//! # The rule
//! The path passes when both hold:
//! 1. it is on a cgroup2 filesystem (`statfs` type `CGROUP2_SUPER_MAGIC`);
//! 2. the cgroup2 mount holding it (`/proc/self/mountinfo`, longest mount point prefix)
//!    exposes the whole hierarchy: either
//!    - the agent is in the **initial** cgroup namespace (its `/proc/self/ns/cgroup` inode is
//!      the kernel's `PROC_CGROUP_INIT_INO`, 0xEFFFFFFB) and the mount's root field is `/`
//!      (in the initial namespace the root field is the absolute cgroup path), or
//!    - the mount point is the hierarchy's root cgroup: it has no `cgroup.type` file, which
//!      every non-root cgroup v2 directory has (`man 7 cgroups`). This accepts a private
//!      cgroup namespace whose cgroup2 mount is the host's hierarchy (a DaemonSet's hostPath
//!      `/sys/fs/cgroup`, or a mount inherited by `unshare --cgroup`: its root field reads
//!      `/..`-style, relative to the namespace root), where socket LB covers the whole node.
//!
//! A path *below* such a mount (a dedicated sub-cgroup) passes: the operator chose it on a
//! mount that shows the real hierarchy. Refused: a private cgroup namespace whose cgroup2
//! mount is rooted at the namespace's own cgroup (`/proc/self/cgroup` reads `0::/` while the
//! mount point is not the hierarchy root), and a bind mount of a sub-cgroup (root field other
//! than `/`) used as if it were the root.

use std::fs;
use std::path::{Path, PathBuf};

/// `PROC_CGROUP_INIT_INO` (include/linux/proc_ns.h): the inode of the initial cgroup
/// namespace's `/proc/<pid>/ns/cgroup`.
pub(crate) const PROC_CGROUP_INIT_INO: u64 = 0xEFFF_FFFB;

/// One cgroup2 line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cgroup2Mount {
    /// Field 5: where it is mounted.
    pub mount_point: PathBuf,
    /// Field 4: the cgroup at the mount point, relative to the reader's cgroup namespace root
    /// (`/`, `/kubepods/…`, or `/../..` when above the namespace root).
    pub root: String,
}

/// Every cgroup2 mount of a mountinfo text.
pub(crate) fn cgroup2_mounts(mountinfo: &str) -> Vec<Cgroup2Mount> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (mount, fs) = line.split_once(" - ")?;
            if fs.split_whitespace().next()? != "cgroup2" {
                return None;
            }
            let mut f = mount.split_whitespace();
            let root = unescape(f.nth(3)?);
            let mount_point = PathBuf::from(unescape(f.next()?));
            Some(Cgroup2Mount { mount_point, root })
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..=i + 3].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mount holding `path` (longest mount point that is a prefix of it).
pub(crate) fn mount_holding<'a>(
    mounts: &'a [Cgroup2Mount],
    path: &Path,
) -> Option<&'a Cgroup2Mount> {
    mounts
        .iter()
        .filter(|m| path.starts_with(&m.mount_point))
        .max_by_key(|m| m.mount_point.components().count())
}

/// What [`judge`] decides on (gathered by [`check`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Facts {
    /// The path, canonical.
    pub path: PathBuf,
    /// `statfs` says cgroup2.
    pub on_cgroup2: bool,
    /// The agent runs in the initial cgroup namespace.
    pub initial_namespace: bool,
    /// The cgroup2 mount holding the path.
    pub mount: Option<Cgroup2Mount>,
    /// The mount point has no `cgroup.type` (it is the hierarchy's root cgroup).
    pub mount_point_is_hierarchy_root: bool,
    /// The agent's own cgroup (`/proc/self/cgroup`'s `0::` line), for the message.
    pub own_cgroup: String,
}

/// Why the path is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CgroupCheckError {
    #[error(
        "--bpf-cgroup {path}: not on a cgroup2 filesystem (socket LB needs cgroup v2: pass the \
         host's cgroup2 mount, e.g. /sys/fs/cgroup)"
    )]
    NotCgroup2 { path: PathBuf },
    #[error("--bpf-cgroup {path}: {reason}")]
    Unreadable { path: PathBuf, reason: String },
    #[error(
        "--bpf-cgroup {path}: the cgroup2 mount at {mount_point} shows cgroup {root:?} of a \
         private cgroup namespace (this process' cgroup reads {own_cgroup:?}), not the root of \
         the host's cgroup2 hierarchy: socket LB attached there would cover only the processes \
         below it, not the node's pods. Mount the host's cgroup2 hierarchy (hostPath \
         /sys/fs/cgroup) and pass that, or run kproxy in the host's cgroup namespace"
    )]
    PrivateNamespace {
        path: PathBuf,
        mount_point: PathBuf,
        root: String,
        own_cgroup: String,
    },
    #[error(
        "--bpf-cgroup {path}: the cgroup2 mount at {mount_point} is a bind mount of cgroup \
         {root:?}, not the root of the cgroup2 hierarchy: socket LB attached there would cover \
         only the processes below it. Pass the host's cgroup2 mount (e.g. /sys/fs/cgroup)"
    )]
    SubtreeMount {
        path: PathBuf,
        mount_point: PathBuf,
        root: String,
    },
}

/// The rule of the module docs (pure).
pub(crate) fn judge(f: &Facts) -> Result<(), CgroupCheckError> {
    if !f.on_cgroup2 {
        return Err(CgroupCheckError::NotCgroup2 {
            path: f.path.clone(),
        });
    }
    let Some(m) = &f.mount else {
        return Err(CgroupCheckError::Unreadable {
            path: f.path.clone(),
            reason: "no cgroup2 mount in /proc/self/mountinfo holds it".into(),
        });
    };
    if (f.initial_namespace && m.root == "/") || f.mount_point_is_hierarchy_root {
        return Ok(());
    }
    if f.initial_namespace {
        Err(CgroupCheckError::SubtreeMount {
            path: f.path.clone(),
            mount_point: m.mount_point.clone(),
            root: m.root.clone(),
        })
    } else {
        Err(CgroupCheckError::PrivateNamespace {
            path: f.path.clone(),
            mount_point: m.mount_point.clone(),
            root: m.root.clone(),
            own_cgroup: f.own_cgroup.clone(),
        })
    }
}

/// Gathers the [`Facts`] about `path` from this process' view of the system.
pub(crate) fn facts(path: &Path) -> Result<Facts, CgroupCheckError> {
    let unreadable = |reason: String| CgroupCheckError::Unreadable {
        path: path.to_path_buf(),
        reason,
    };
    let canonical = fs::canonicalize(path).map_err(|e| unreadable(e.to_string()))?;
    let on_cgroup2 = nix::sys::statfs::statfs(&canonical)
        .map(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
        .map_err(|e| unreadable(format!("statfs: {e}")))?;
    let initial_namespace = {
        use std::os::unix::fs::MetadataExt;
        fs::metadata("/proc/self/ns/cgroup")
            .map(|m| m.ino() == PROC_CGROUP_INIT_INO)
            .map_err(|e| unreadable(format!("reading /proc/self/ns/cgroup: {e}")))?
    };
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| unreadable(format!("reading /proc/self/mountinfo: {e}")))?;
    let mounts = cgroup2_mounts(&mountinfo);
    let mount = mount_holding(&mounts, &canonical).cloned();
    let mount_point_is_hierarchy_root = mount
        .as_ref()
        .is_some_and(|m| !m.mount_point.join("cgroup.type").exists());
    let own_cgroup = fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("0::").map(str::to_owned))
        })
        .unwrap_or_default();
    Ok(Facts {
        path: canonical,
        on_cgroup2,
        initial_namespace,
        mount,
        mount_point_is_hierarchy_root,
        own_cgroup,
    })
}

/// Checks `path` (see the module docs).
pub(crate) fn check(path: &Path) -> Result<(), CgroupCheckError> {
    judge(&facts(path)?)
}

/// The cgroup2 mount point from `/proc/self/mountinfo` (default socket-LB attach point).
pub(crate) fn cgroup2_root() -> Option<PathBuf> {
    let text = fs::read_to_string("/proc/self/mountinfo").ok()?;
    text.lines().find_map(|line| {
        let (mount, fs) = line.split_once(" - ")?;
        (fs.split_whitespace().next()? == "cgroup2")
            .then(|| mount.split_whitespace().nth(4).map(PathBuf::from))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
90 80 0:38 /../../.. /host/cgroup rw,relatime - cgroup2 cgroup2 rw
91 80 0:38 /kubepods/pod1 /my\\040cg rw,relatime - cgroup2 cgroup2 rw
";

    fn facts(path: &str, init: bool, root_dir: bool) -> Facts {
        let mounts = cgroup2_mounts(MOUNTINFO);
        Facts {
            path: PathBuf::from(path),
            on_cgroup2: true,
            initial_namespace: init,
            mount: mount_holding(&mounts, Path::new(path)).cloned(),
            mount_point_is_hierarchy_root: root_dir,
            own_cgroup: "/".into(),
        }
    }

    #[test]
    fn parses_cgroup2_mounts_only_with_unescaped_paths() {
        let m = cgroup2_mounts(MOUNTINFO);
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].mount_point, PathBuf::from("/sys/fs/cgroup/unified"));
        assert_eq!(m[0].root, "/");
        assert_eq!(m[1].root, "/../../..");
        assert_eq!(m[2].mount_point, PathBuf::from("/my cg"));
        assert_eq!(
            mount_holding(&m, Path::new("/sys/fs/cgroup/unified/test/a"))
                .unwrap()
                .mount_point,
            PathBuf::from("/sys/fs/cgroup/unified")
        );
        assert!(mount_holding(&m, Path::new("/sys/fs/cgroup/cpu")).is_none());
    }

    #[test]
    fn the_host_root_and_sub_cgroups_of_it_pass_in_the_initial_namespace() {
        assert_eq!(judge(&facts("/sys/fs/cgroup/unified", true, true)), Ok(()));
        // A dedicated sub-cgroup on the host's mount (what the tests pass).
        assert_eq!(
            judge(&facts("/sys/fs/cgroup/unified/kp-test", true, true)),
            Ok(())
        );
    }

    #[test]
    fn a_private_namespace_passes_only_with_the_hosts_hierarchy_mounted() {
        // hostPath /sys/fs/cgroup in a container: the mount's root is above the namespace.
        assert_eq!(judge(&facts("/host/cgroup", false, true)), Ok(()));
        // The container's own cgroup2 mount: refused, naming why.
        let f = Facts {
            mount: Some(Cgroup2Mount {
                mount_point: "/sys/fs/cgroup".into(),
                root: "/".into(),
            }),
            ..facts("/sys/fs/cgroup", false, false)
        };
        let e = judge(&f).unwrap_err();
        assert!(
            matches!(e, CgroupCheckError::PrivateNamespace { .. }),
            "{e}"
        );
        assert!(e.to_string().contains("private cgroup namespace"), "{e}");
    }

    #[test]
    fn a_bind_mounted_subtree_and_non_cgroup2_paths_are_refused() {
        let e = judge(&facts("/my cg", true, false)).unwrap_err();
        assert!(matches!(e, CgroupCheckError::SubtreeMount { .. }), "{e}");
        let f = Facts {
            on_cgroup2: false,
            ..facts("/sys/fs/cgroup/unified", true, true)
        };
        assert!(matches!(
            judge(&f),
            Err(CgroupCheckError::NotCgroup2 { .. })
        ));
    }
}
