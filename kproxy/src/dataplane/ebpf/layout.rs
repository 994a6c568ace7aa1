//! Pinned-map layouts across versions: before the object is loaded over `<bpffs>/kproxy/`,
//! every pinned map is checked against this build's layout (`kproxy_common::layout`: type,
//! key/value sizes, a hand-kept version) and the version recorded for it in the pinned
//! `KP_LAYOUT` map, and then deliberately:
//!
//! - **reused** when the layout is this build's (or an older version that the table declares
//!   byte-compatible, with the same sizes; a pin without a record counts as version 1, what
//!   every build before records had);
//! - **carried over** when the table allows it (`carry_from`: same type and key, the old value
//!   a prefix of the new one — fields were only appended): a new map of this build's layout
//!   and the old `max_entries` is created, every entry copied with the new bytes zeroed, and
//!   the new map pinned over the old one (`rename`, atomic). Established connections
//!   (`KP_CT`), affinity and socket reverse NAT survive the upgrade. Entries the old programs
//!   add while the copy runs are lost;
//! - **replaced** otherwise (another type or key, a shorter value, a layout from a newer
//!   kproxy, a record that contradicts the pin, or a failed carry-over): the pin is removed
//!   with a warning naming the old and new layouts, and the loader creates an empty map.
//!   Service maps are reprogrammed by the next sync; connections tracked only there are lost.
//!
//! The record is rewritten for every map afterwards. Old and new layouts are never mixed: when
//! any map was carried over or replaced, the pinned socket-LB links (whose programs still
//! reference the old maps) are removed too, so the loader attaches this build's programs
//! against the new maps (a gap of a few milliseconds in which connects are not translated);
//! the TC links always get this build's programs on start (`node_path::tc`).

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use kproxy_common::layout::{
    LAYOUT_ENTRIES, LAYOUT_NAME_LEN, LAYOUTS, LayoutRecord, MAP_LAYOUT, MAP_TYPE_HASH,
    MAP_TYPE_LRU_HASH, MapLayout, UNRECORDED_VERSION, layout_key,
};

/// A pinned map as the kernel describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pinned {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub map_flags: u32,
}

/// What was done with one pinned map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Used as it is.
    Reuse,
    /// Entries copied into a map of this build's layout, which replaced the pin.
    Migrate,
    /// Removed (the loader creates an empty one), for this reason.
    Replace(String),
}

/// What `reconcile` did, per pinned map found (maps not pinned yet are not listed).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayoutReport {
    pub maps: Vec<(&'static str, Action)>,
    /// Entries carried over, per migrated map.
    pub carried: BTreeMap<&'static str, usize>,
}

impl LayoutReport {
    /// Whether any map was carried over or replaced.
    pub fn changed(&self) -> bool {
        self.maps.iter().any(|(_, a)| *a != Action::Reuse)
    }
}

/// Errors of checking or rewriting pins.
#[derive(Debug, thiserror::Error)]
#[error("pinned map {path}: {reason}")]
pub struct LayoutError {
    pub path: PathBuf,
    pub reason: String,
}

fn describe(map_type: u32, key: u32, value: u32, version: u32) -> String {
    format!("type {map_type}, key {key} B, value {value} B, version {version}")
}

/// Decides what to do with a pinned map (pure; see the module docs).
pub(crate) fn decide(want: &MapLayout, pinned: &Pinned, recorded: Option<&LayoutRecord>) -> Action {
    let version = match recorded {
        None => UNRECORDED_VERSION,
        Some(r)
            if (r.map_type, r.key_size, r.value_size)
                == (pinned.map_type, pinned.key_size, pinned.value_size) =>
        {
            r.version
        }
        Some(r) => {
            return Action::Replace(format!(
                "its layout record ({}) does not describe it ({})",
                describe(r.map_type, r.key_size, r.value_size, r.version),
                describe(pinned.map_type, pinned.key_size, pinned.value_size, 0)
            ));
        }
    };
    let same_sizes = (pinned.map_type, pinned.key_size, pinned.value_size)
        == (want.map_type, want.key_size, want.value_size);
    if same_sizes && version == want.version {
        return Action::Reuse;
    }
    let old = describe(pinned.map_type, pinned.key_size, pinned.value_size, version);
    let new = describe(want.map_type, want.key_size, want.value_size, want.version);
    if version > want.version {
        return Action::Replace(format!(
            "created by a newer kproxy ({old}; this build: {new})"
        ));
    }
    let carry = want.carry_from.is_some_and(|c| version >= c)
        && pinned.map_type == want.map_type
        && matches!(want.map_type, MAP_TYPE_HASH | MAP_TYPE_LRU_HASH)
        && pinned.key_size == want.key_size
        && pinned.value_size <= want.value_size;
    match (carry, same_sizes) {
        (true, true) => Action::Reuse,
        (true, false) => Action::Migrate,
        _ => Action::Replace(format!(
            "its layout ({old}) is not this build's ({new}) and cannot be carried over"
        )),
    }
}

// --- raw bpf(2): maps of a size known only at run time -------------------------------------

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const ATTR_LEN: usize = 128;

fn sys_bpf(cmd: libc::c_long, attr: &mut [u8; ATTR_LEN]) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a zero-initialised bpf_attr of ATTR_LEN bytes; pointers inside it point
    // at buffers that outlive the call.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), ATTR_LEN) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn put_u32(attr: &mut [u8; ATTR_LEN], at: usize, v: u32) {
    attr[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}
fn put_u64(attr: &mut [u8; ATTR_LEN], at: usize, v: u64) {
    attr[at..at + 8].copy_from_slice(&v.to_ne_bytes());
}

/// `BPF_MAP_CREATE` without BTF.
fn create_map(name: &str, p: &Pinned) -> io::Result<OwnedFd> {
    let mut attr = [0u8; ATTR_LEN];
    put_u32(&mut attr, 0, p.map_type);
    put_u32(&mut attr, 4, p.key_size);
    put_u32(&mut attr, 8, p.value_size);
    put_u32(&mut attr, 12, p.max_entries);
    put_u32(&mut attr, 16, p.map_flags);
    let n = name.len().min(15);
    attr[28..28 + n].copy_from_slice(&name.as_bytes()[..n]);
    let fd = sys_bpf(BPF_MAP_CREATE, &mut attr)?;
    // SAFETY: a new fd the kernel just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

fn elem_attr(fd: RawFd, key: *const u8, value: *const u8, flags: u64) -> [u8; ATTR_LEN] {
    let mut attr = [0u8; ATTR_LEN];
    put_u32(&mut attr, 0, fd as u32);
    put_u64(&mut attr, 8, key as u64);
    put_u64(&mut attr, 16, value as u64);
    put_u64(&mut attr, 24, flags);
    attr
}

/// The key after `key` (the first with `None`); `false` at the end.
fn next_key(fd: RawFd, key: Option<&[u8]>, next: &mut [u8]) -> io::Result<bool> {
    let mut attr = elem_attr(
        fd,
        key.map_or(std::ptr::null(), <[u8]>::as_ptr),
        next.as_mut_ptr(),
        0,
    );
    match sys_bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

fn lookup(fd: RawFd, key: &[u8], value: &mut [u8]) -> io::Result<bool> {
    let mut attr = elem_attr(fd, key.as_ptr(), value.as_mut_ptr(), 0);
    match sys_bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

fn update(fd: RawFd, key: &[u8], value: &[u8]) -> io::Result<()> {
    let mut attr = elem_attr(fd, key.as_ptr(), value.as_ptr(), 0);
    sys_bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(|_| ())
}

/// Copies `old` into a new map of layout `want` (values zero-extended) and pins it over
/// `pin`. Returns the entries copied.
fn migrate(old: &MapData, old_info: &Pinned, want: &MapLayout, pin: &Path) -> io::Result<usize> {
    let new_info = Pinned {
        value_size: want.value_size,
        ..*old_info
    };
    let new = create_map(want.name, &new_info)?;
    let (src, dst) = (old.fd().as_fd().as_raw_fd(), new.as_raw_fd());
    let mut key = vec![0u8; old_info.key_size as usize];
    let mut next = key.clone();
    let mut value = vec![0u8; want.value_size as usize];
    let mut copied = 0usize;
    let mut first = true;
    // get_next_key restarts from the beginning if the current key vanished meanwhile; the
    // bound keeps that from looping forever on a busy map.
    let bound = 2 * old_info.max_entries as usize + 16;
    for _ in 0..bound {
        if !next_key(src, (!first).then_some(&key[..]), &mut next)? {
            break;
        }
        first = false;
        key.copy_from_slice(&next);
        value.fill(0);
        if lookup(src, &key, &mut value[..old_info.value_size as usize])? {
            update(dst, &key, &value)?;
            copied += 1;
        }
    }
    let data = MapData::from_fd(new).map_err(io::Error::other)?;
    // bpffs refuses names with a dot.
    let tmp = pin.with_file_name(format!("{}_migrating", want.name));
    let _ = fs::remove_file(&tmp);
    data.pin(&tmp)
        .map_err(|e| match std::error::Error::source(&e) {
            Some(cause) => io::Error::other(format!("{e}: {cause}")),
            None => io::Error::other(e.to_string()),
        })?;
    fs::rename(&tmp, pin).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })?;
    Ok(copied)
}

fn pinned_info(data: &MapData) -> Result<Pinned, String> {
    let info = data.info().map_err(|e| e.to_string())?;
    let map_type = info.map_type().map_err(|e| e.to_string())? as u32;
    Ok(Pinned {
        map_type,
        key_size: info.key_size(),
        value_size: info.value_size(),
        max_entries: info.max_entries(),
        map_flags: info.map_flags(),
    })
}

type RecordMap = BpfHashMap<MapData, [u8; LAYOUT_NAME_LEN], LayoutRecord>;

/// Opens (or creates and pins) `KP_LAYOUT`. A pinned one of another shape is replaced.
fn record_map(dir: &Path) -> Result<RecordMap, LayoutError> {
    let path = dir.join(MAP_LAYOUT);
    let err = |reason: String| LayoutError {
        path: path.clone(),
        reason,
    };
    if path.exists() {
        match MapData::from_pin(&path)
            .and_then(Map::from_map_data)
            .and_then(RecordMap::try_from)
        {
            Ok(m) => return Ok(m),
            Err(e) => {
                tracing::warn!(map = MAP_LAYOUT, error = %e, "unreadable layout record replaced");
                fs::remove_file(&path).map_err(|e| err(format!("removing: {e}")))?;
            }
        }
    }
    let shape = Pinned {
        map_type: MAP_TYPE_HASH,
        key_size: LAYOUT_NAME_LEN as u32,
        value_size: size_of::<LayoutRecord>() as u32,
        max_entries: LAYOUT_ENTRIES,
        map_flags: 0,
    };
    let fd = create_map(MAP_LAYOUT, &shape).map_err(|e| err(format!("creating: {e}")))?;
    let data = MapData::from_fd(fd).map_err(|e| err(e.to_string()))?;
    data.pin(&path).map_err(|e| err(format!("pinning: {e}")))?;
    Map::from_map_data(data)
        .and_then(RecordMap::try_from)
        .map_err(|e| err(e.to_string()))
}

/// Checks every pinned map under `dir` (see the module docs), removes the pins in
/// `links_on_change` if any map was carried over or replaced, and records this build's
/// layouts. Run before the object is loaded.
pub(crate) fn reconcile(
    dir: &Path,
    links_on_change: &[PathBuf],
) -> Result<LayoutReport, LayoutError> {
    let mut records = record_map(dir)?;
    let mut report = LayoutReport::default();
    for want in &LAYOUTS {
        let pin = dir.join(want.name);
        if !pin.exists() {
            continue;
        }
        let lerr = |reason: String| LayoutError {
            path: pin.clone(),
            reason,
        };
        let data = MapData::from_pin(&pin).map_err(|e| lerr(format!("opening: {e}")))?;
        let info = pinned_info(&data).map_err(|e| lerr(format!("reading its info: {e}")))?;
        let recorded = records.get(&layout_key(want.name), 0).ok();
        let mut action = decide(want, &info, recorded.as_ref());
        if action == Action::Migrate {
            match migrate(&data, &info, want, &pin) {
                Ok(n) => {
                    tracing::info!(
                        map = want.name,
                        entries = n,
                        from_value_size = info.value_size,
                        to_value_size = want.value_size,
                        "carried the pinned map's entries over to this build's layout"
                    );
                    report.carried.insert(want.name, n);
                }
                Err(e) => {
                    action = Action::Replace(format!("carrying its entries over failed: {e}"))
                }
            }
        }
        if let Action::Replace(reason) = &action {
            tracing::warn!(
                map = want.name,
                "replacing the pinned map: {reason}; it starts empty"
            );
            fs::remove_file(&pin).map_err(|e| lerr(format!("removing: {e}")))?;
        }
        report.maps.push((want.name, action));
    }
    if report.changed() {
        for link in links_on_change.iter().filter(|l| l.exists()) {
            fs::remove_file(link).map_err(|e| LayoutError {
                path: link.clone(),
                reason: format!("removing the link pinned by the previous build: {e}"),
            })?;
            tracing::info!(link = %link.display(), "detached a program of the previous map layout");
        }
    }
    for want in &LAYOUTS {
        let record = LayoutRecord {
            version: want.version,
            map_type: want.map_type,
            key_size: want.key_size,
            value_size: want.value_size,
        };
        records
            .insert(layout_key(want.name), record, 0)
            .map_err(|e| LayoutError {
                path: dir.join(MAP_LAYOUT),
                reason: format!("recording {}: {e}", want.name),
            })?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(value: u32, version: u32, carry_from: Option<u32>) -> MapLayout {
        MapLayout {
            name: "KP_T",
            map_type: MAP_TYPE_LRU_HASH,
            key_size: 16,
            value_size: value,
            version,
            carry_from,
        }
    }

    fn pinned(map_type: u32, key: u32, value: u32) -> Pinned {
        Pinned {
            map_type,
            key_size: key,
            value_size: value,
            max_entries: 1024,
            map_flags: 0,
        }
    }

    fn record(p: &Pinned, version: u32) -> LayoutRecord {
        LayoutRecord {
            version,
            map_type: p.map_type,
            key_size: p.key_size,
            value_size: p.value_size,
        }
    }

    #[test]
    fn same_layout_is_reused_recorded_or_not() {
        let w = want(32, 1, None);
        let p = pinned(MAP_TYPE_LRU_HASH, 16, 32);
        assert_eq!(decide(&w, &p, None), Action::Reuse);
        assert_eq!(decide(&w, &p, Some(&record(&p, 1))), Action::Reuse);
    }

    #[test]
    fn appended_fields_are_carried_over_when_the_table_allows() {
        let w = want(40, 2, Some(1));
        let p = pinned(MAP_TYPE_LRU_HASH, 16, 32);
        assert_eq!(decide(&w, &p, Some(&record(&p, 1))), Action::Migrate);
        assert_eq!(decide(&w, &p, None), Action::Migrate);
        // Same bytes, an older compatible version: nothing to copy.
        let same = pinned(MAP_TYPE_LRU_HASH, 16, 40);
        assert_eq!(decide(&w, &same, Some(&record(&same, 1))), Action::Reuse);
    }

    #[test]
    fn everything_else_is_replaced() {
        let p = pinned(MAP_TYPE_LRU_HASH, 16, 32);
        let cases = [
            // The meaning changed (carry_from moved past the old version).
            (
                want(40, 2, Some(2)),
                p,
                Some(record(&p, 1)),
                "cannot be carried over",
            ),
            // Not carried at all.
            (
                want(40, 2, None),
                p,
                Some(record(&p, 1)),
                "cannot be carried over",
            ),
            // Same sizes, another meaning.
            (
                want(32, 2, None),
                p,
                Some(record(&p, 1)),
                "cannot be carried over",
            ),
            // A shorter value.
            (
                want(24, 1, Some(1)),
                p,
                Some(record(&p, 1)),
                "cannot be carried over",
            ),
            // Another key.
            (
                want(32, 1, Some(1)),
                pinned(MAP_TYPE_LRU_HASH, 8, 32),
                None,
                "cannot be carried over",
            ),
            // Another type.
            (
                want(32, 1, Some(1)),
                pinned(MAP_TYPE_HASH, 16, 32),
                None,
                "cannot be carried over",
            ),
            // A downgrade.
            (want(32, 1, Some(1)), p, Some(record(&p, 3)), "newer kproxy"),
        ];
        for (w, p, r, why) in cases {
            match decide(&w, &p, r.as_ref()) {
                Action::Replace(reason) => assert!(reason.contains(why), "{reason}"),
                a => panic!("{w:?} over {p:?} ({r:?}): {a:?}"),
            }
        }
        // A record that contradicts the pin.
        let mut bad = record(&p, 1);
        bad.value_size = 24;
        assert!(matches!(decide(&want(32, 1, Some(1)), &p, Some(&bad)),
            Action::Replace(r) if r.contains("does not describe")));
    }

    /// Every pinned map of the built object is in the layout table, with its real shape.
    /// `LAYOUTS` is the one list of pinned maps (mode detection, inspect and this check read
    /// it): every pinned map of the object has its row, and every row its map.
    #[test]
    fn the_table_matches_the_object() {
        if !crate::dataplane::ebpf::object::is_built() {
            eprintln!("skipped: no BPF object");
            return;
        }
        let obj = aya_obj::Object::parse(crate::dataplane::ebpf::object::OBJECT).unwrap();
        let mut pinned = 0;
        for (name, map) in &obj.maps {
            if map.pinning() != aya_obj::maps::PinningType::ByName {
                continue;
            }
            pinned += 1;
            let l = kproxy_common::layout::find(name)
                .unwrap_or_else(|| panic!("pinned map {name} has no layout"));
            assert_eq!(
                (map.map_type(), map.key_size(), map.value_size()),
                (l.map_type, l.key_size, l.value_size),
                "{name}"
            );
        }
        assert_eq!(pinned, LAYOUTS.len());
    }
}
