//! The pin directory `<bpffs>/kproxy/` every pinned map and socket-LB link of the mode lives
//! in, and the bpffs under it: making sure it is one, and removing everything pinned there.

use std::fs;
use std::path::{Path, PathBuf};

/// `BPF_FS_MAGIC` (statfs f_type of a bpffs).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// `path` is not a bpffs and none could be mounted there.
#[derive(Debug, thiserror::Error)]
#[error("bpffs at {path}: {reason}")]
pub struct BpffsError {
    pub path: PathBuf,
    pub reason: String,
}

/// Makes sure `path` is a bpffs (mounting one if it is not).
pub(crate) fn ensure_bpffs(path: &Path) -> Result<(), BpffsError> {
    let err = |reason: String| BpffsError {
        path: path.to_path_buf(),
        reason,
    };
    fs::create_dir_all(path).map_err(|e| err(format!("creating the directory: {e}")))?;
    let st = nix::sys::statfs::statfs(path).map_err(|e| err(format!("statfs: {e}")))?;
    if st.filesystem_type().0 as i64 == BPF_FS_MAGIC {
        return Ok(());
    }
    nix::mount::mount(
        Some("bpf"),
        path,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|e| err(format!("not a bpffs and mounting one failed: {e}")))?;
    tracing::info!(path = %path.display(), "mounted bpffs");
    Ok(())
}

/// `<bpffs>/kproxy`.
pub(crate) fn pin_dir(bpffs: &Path) -> PathBuf {
    bpffs.join("kproxy")
}

/// Where the socket-LB links are pinned, under the pin directory.
pub(crate) fn link_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join("links")
}

/// Removes `<bpffs>/kproxy` (links first, so programs detach before their maps go).
pub(crate) fn remove_pins(dir: &Path) -> std::io::Result<()> {
    let links = link_dir(dir);
    if links.exists() {
        for entry in fs::read_dir(&links)? {
            fs::remove_file(entry?.path())?;
        }
        fs::remove_dir(&links)?;
    }
    if dir.exists() {
        for entry in fs::read_dir(dir)? {
            let path = entry?.path();
            if path.is_dir() {
                fs::remove_dir_all(&path)?;
            } else {
                fs::remove_file(&path)?;
            }
        }
        fs::remove_dir(dir)?;
    }
    Ok(())
}
