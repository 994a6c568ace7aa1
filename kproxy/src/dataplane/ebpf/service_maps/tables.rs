//! One map as the applier sees it: dump, put, delete, capacity. [`KernelTable`] is a pinned
//! BPF map (aya); [`MemTable`] is an in-memory stand-in with the same capacity rules, used by
//! the applier's unit tests (no root needed).

use std::collections::BTreeMap;

use aya::Pod;
use aya::maps::lpm_trie::{Key as LpmKey, LpmTrie};
use aya::maps::{HashMap, Map, MapData, MapError};
use kproxy_common::service::SourceRangeKey;

use crate::dataplane::ebpf::service_maps::plan::SourceRangeEntry;

/// A failed map operation, naming the map.
#[derive(Debug, thiserror::Error)]
#[error("BPF map {map}: {reason}")]
pub struct TableError {
    pub map: &'static str,
    pub reason: String,
    /// The map had no room for a new entry (E2BIG).
    pub full: bool,
}

impl TableError {
    fn from_map(map: &'static str, error: MapError) -> Self {
        let full = matches!(&error, MapError::SyscallError(e) if e.io_error.raw_os_error() == Some(libc::E2BIG));
        let reason = if full {
            "map is full (raise its size with --bpf-map-sizes)".to_string()
        } else {
            error.to_string()
        };
        TableError { map, reason, full }
    }
}

/// One key/value map.
pub trait Table<K, V>: Send {
    /// The map's name (for errors and metrics).
    /// Every entry.
    fn dump(&self) -> Result<Vec<(K, V)>, TableError>;
    /// Insert or replace.
    fn put(&mut self, key: &K, value: &V) -> Result<(), TableError>;
    /// Delete; a missing key is not an error.
    fn delete(&mut self, key: &K) -> Result<(), TableError>;
    /// `max_entries`.
    fn capacity(&self) -> u32;
}

/// A BPF hash or LRU hash map.
pub(crate) struct KernelTable<K: Pod, V: Pod> {
    name: &'static str,
    map: HashMap<MapData, K, V>,
    capacity: u32,
}

/// Fails when a (possibly pinned by an older kproxy) map's key or value size is not the one
/// this build uses: reusing it would corrupt lookups.
fn check_layout(
    name: &'static str,
    info: &aya::maps::MapInfo,
    key: usize,
    value: usize,
) -> Result<(), TableError> {
    if info.key_size() as usize != key || info.value_size() as usize != value {
        return Err(TableError {
            map: name,
            reason: format!(
                "the pinned map has key/value sizes {}/{} bytes, this kproxy uses {key}/{value}: \
                 it was created by another version; remove it with `kproxy cleanup`",
                info.key_size(),
                info.value_size()
            ),
            full: false,
        });
    }
    Ok(())
}

impl<K: Pod, V: Pod> KernelTable<K, V> {
    pub(crate) fn new(name: &'static str, data: MapData) -> Result<Self, TableError> {
        let info = data.info().map_err(|e| TableError::from_map(name, e))?;
        check_layout(name, &info, size_of::<K>(), size_of::<V>())?;
        let capacity = info.max_entries();
        let map = Map::from_map_data(data)
            .and_then(HashMap::try_from)
            .map_err(|e| TableError::from_map(name, e))?;
        Ok(KernelTable {
            name,
            map,
            capacity,
        })
    }
}

impl<K: Pod + Send, V: Pod + Send> Table<K, V> for KernelTable<K, V> {
    fn dump(&self) -> Result<Vec<(K, V)>, TableError> {
        let mut out = Vec::new();
        for item in self.map.iter() {
            match item {
                Ok(kv) => out.push(kv),
                // Deleted between get_next_key and lookup (LRU eviction, BPF-side delete).
                Err(MapError::KeyNotFound) => continue,
                Err(e) => return Err(TableError::from_map(self.name, e)),
            }
        }
        Ok(out)
    }
    fn put(&mut self, key: &K, value: &V) -> Result<(), TableError> {
        self.map
            .insert(key, value, 0)
            .map_err(|e| TableError::from_map(self.name, e))
    }
    fn delete(&mut self, key: &K) -> Result<(), TableError> {
        match self.map.remove(key) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(())
            }
            Err(e) => Err(TableError::from_map(self.name, e)),
        }
    }
    fn capacity(&self) -> u32 {
        self.capacity
    }
}

/// The source-range LPM trie, keyed by `(prefix length, data)`.
pub(crate) struct KernelLpmTable {
    name: &'static str,
    map: LpmTrie<MapData, SourceRangeKey, u8>,
    capacity: u32,
}

impl KernelLpmTable {
    pub(crate) fn new(name: &'static str, data: MapData) -> Result<Self, TableError> {
        let info = data.info().map_err(|e| TableError::from_map(name, e))?;
        check_layout(name, &info, 4 + size_of::<SourceRangeKey>(), 1)?;
        let capacity = info.max_entries();
        let map = Map::from_map_data(data)
            .and_then(LpmTrie::try_from)
            .map_err(|e| TableError::from_map(name, e))?;
        Ok(KernelLpmTable {
            name,
            map,
            capacity,
        })
    }
}

impl Table<SourceRangeEntry, u8> for KernelLpmTable {
    fn dump(&self) -> Result<Vec<(SourceRangeEntry, u8)>, TableError> {
        let mut out = Vec::new();
        for item in self.map.iter() {
            match item {
                Ok((k, v)) => out.push(((k.prefix_len(), k.data()), v)),
                Err(MapError::KeyNotFound) => continue,
                Err(e) => return Err(TableError::from_map(self.name, e)),
            }
        }
        Ok(out)
    }
    fn put(&mut self, key: &SourceRangeEntry, value: &u8) -> Result<(), TableError> {
        self.map
            .insert(&LpmKey::new(key.0, key.1), value, 0)
            .map_err(|e| TableError::from_map(self.name, e))
    }
    fn delete(&mut self, key: &SourceRangeEntry) -> Result<(), TableError> {
        match self.map.remove(&LpmKey::new(key.0, key.1)) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(())
            }
            Err(e) => Err(TableError::from_map(self.name, e)),
        }
    }
    fn capacity(&self) -> u32 {
        self.capacity
    }
}

/// An in-memory map with a capacity, for tests of the applier.
#[derive(Debug, Clone)]
pub(crate) struct MemTable<K: Ord, V> {
    pub name: &'static str,
    pub entries: BTreeMap<K, V>,
    pub capacity: u32,
    /// Count of successful puts (tests assert the applier writes only what changed).
    pub writes: usize,
}

impl<K: Ord, V> MemTable<K, V> {
    #[cfg(test)]
    pub fn new(name: &'static str, capacity: u32) -> Self {
        MemTable {
            name,
            entries: BTreeMap::new(),
            capacity,
            writes: 0,
        }
    }
}

impl<K: Ord + Clone + Send, V: Clone + Send> Table<K, V> for MemTable<K, V> {
    fn dump(&self) -> Result<Vec<(K, V)>, TableError> {
        Ok(self
            .entries
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }
    fn put(&mut self, key: &K, value: &V) -> Result<(), TableError> {
        if !self.entries.contains_key(key) && self.entries.len() >= self.capacity as usize {
            return Err(TableError {
                map: self.name,
                reason: "map is full (raise its size with --bpf-map-sizes)".into(),
                full: true,
            });
        }
        self.entries.insert(key.clone(), value.clone());
        self.writes += 1;
        Ok(())
    }
    fn delete(&mut self, key: &K) -> Result<(), TableError> {
        self.entries.remove(key);
        Ok(())
    }
    fn capacity(&self) -> u32 {
        self.capacity
    }
}

/// A shared handle to a [`MemTable`], so a test can inspect what the applier wrote.
pub(crate) type SharedMem<K, V> = std::sync::Arc<std::sync::Mutex<MemTable<K, V>>>;

impl<K: Ord + Clone + Send, V: Clone + Send> Table<K, V> for SharedMem<K, V> {
    fn dump(&self) -> Result<Vec<(K, V)>, TableError> {
        self.lock().expect("poisoned").dump()
    }
    fn put(&mut self, key: &K, value: &V) -> Result<(), TableError> {
        self.lock().expect("poisoned").put(key, value)
    }
    fn delete(&mut self, key: &K) -> Result<(), TableError> {
        self.lock().expect("poisoned").delete(key)
    }
    fn capacity(&self) -> u32 {
        self.lock().expect("poisoned").capacity
    }
}

/// The Maglev table array (`KP_MAGLEV`, see `kproxy_common::maglev`): tables of
/// [`MaglevStore::table_size`] backend ids back to back.
pub trait MaglevStore: Send {
    /// Entries per table (`M`).
    fn table_size(&self) -> u32;
    /// Backend ids the array holds.
    fn entries(&self) -> u32;
    /// Number of whole tables the array holds.
    fn tables(&self) -> u32 {
        self.entries() / self.table_size().max(1)
    }
    /// `len` entries from `base`.
    #[cfg_attr(not(test), allow(dead_code))] // read by the tests' in-memory tables
    fn read(&self, base: u32, len: u32) -> Vec<u32>;
    /// Makes entries `base..base + table.len()` hold `table`, writing only those that differ
    /// (each entry is one aligned 4-byte store, so a reader sees the old or the new backend id
    /// of an entry, never a mix). Returns the number of entries written.
    fn write(&mut self, base: u32, table: &[u32]) -> Result<usize, TableError>;
}

/// A pinned `BPF_F_MMAPABLE` array mapped into the agent (shared), so elements are written
/// with memory stores instead of one `bpf(2)` call each. The kernel side only reads.
pub(crate) struct SharedArray {
    _map: MapData,
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value and only accessed through atomics.
unsafe impl Send for SharedArray {}

impl SharedArray {
    /// Maps `data` (map `name`), checking its key and value sizes; returns it and its
    /// `max_entries`.
    pub(crate) fn new(
        name: &'static str,
        data: MapData,
        value: usize,
    ) -> Result<(Self, u32), TableError> {
        use std::os::fd::{AsFd, AsRawFd};
        let info = data.info().map_err(|e| TableError::from_map(name, e))?;
        check_layout(name, &info, 4, value)?;
        // The kernel lays array elements out 8-byte aligned: the mapping is a flat array of
        // `value`-byte elements only when `value` is a multiple of 8.
        assert!(
            value.is_multiple_of(8),
            "{name}: element size {value} is not a multiple of 8"
        );
        let err = |reason: String| TableError {
            map: name,
            reason,
            full: false,
        };
        if info.map_flags() & kproxy_common::BPF_F_MMAPABLE == 0 {
            return Err(err(
                "the pinned map is not mmapable: created by another kproxy version; remove it \
                 with `kproxy cleanup`"
                    .into(),
            ));
        }
        let len = (info.max_entries() as usize * value).max(1);
        // SAFETY: a shared mapping of the map's fd (kernel-checked length and flags); the
        // pointer is only dereferenced within `len` (checked by the accessors) and unmapped
        // on drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                data.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(err(format!("mmap: {}", std::io::Error::last_os_error())));
        }
        let array = SharedArray {
            _map: data,
            ptr: std::ptr::NonNull::new(ptr.cast()).expect("mmap returned NULL"),
            len,
        };
        Ok((array, info.max_entries()))
    }

    /// The `i`-th `T` of the mapping, for `T` an atomic integer (`AtomicU32`, `AtomicU64`:
    /// alignment equal to size).
    fn at<T>(&self, i: u32) -> &T {
        let size = std::mem::size_of::<T>();
        assert_eq!(std::mem::align_of::<T>(), size);
        assert!(
            (i as usize + 1) * size <= self.len,
            "element {i} of {size} bytes out of {} bytes",
            self.len
        );
        // SAFETY: within the mapping; the base is page-aligned and elements are `size`-strided,
        // so aligned for `T`; the atomics have their integer's layout.
        unsafe { &*self.ptr.as_ptr().cast::<T>().add(i as usize) }
    }
}

impl Drop for SharedArray {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `new` mapped.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// [`MaglevStore`] on the pinned mmapable array: a table is rewritten with memory stores.
pub(crate) struct KernelMaglev {
    array: SharedArray,
    entries: u32,
    table_size: u32,
}

impl KernelMaglev {
    pub(crate) fn new(
        name: &'static str,
        data: MapData,
        table_size: u32,
    ) -> Result<Self, TableError> {
        let elem = 4 * kproxy_common::maglev::IDS_PER_ELEM as usize;
        let (array, max_entries) = SharedArray::new(name, data, elem)?;
        // Elements of `elem` bytes hold IDS_PER_ELEM ids each: the mapping is a flat u32 array.
        let entries = max_entries.saturating_mul(kproxy_common::maglev::IDS_PER_ELEM);
        Ok(KernelMaglev {
            array,
            entries,
            table_size,
        })
    }

    fn slot(&self, i: u32) -> &std::sync::atomic::AtomicU32 {
        assert!(i < self.entries, "Maglev entry {i} out of {}", self.entries);
        self.array.at::<std::sync::atomic::AtomicU32>(i)
    }
}

impl MaglevStore for KernelMaglev {
    fn table_size(&self) -> u32 {
        self.table_size
    }
    fn entries(&self) -> u32 {
        self.entries
    }
    fn read(&self, base: u32, len: u32) -> Vec<u32> {
        use std::sync::atomic::Ordering::Relaxed;
        (base..base + len)
            .map(|i| self.slot(i).load(Relaxed))
            .collect()
    }
    fn write(&mut self, base: u32, table: &[u32]) -> Result<usize, TableError> {
        use std::sync::atomic::Ordering::{Relaxed, Release};
        if u64::from(base) + table.len() as u64 > u64::from(self.entries) {
            return Err(TableError {
                map: kproxy_common::maglev::MAP_MAGLEV,
                reason: format!("table at {base} does not fit in {} entries", self.entries),
                full: true,
            });
        }
        let mut written = 0;
        for (i, v) in table.iter().enumerate() {
            let e = self.slot(base + i as u32);
            if e.load(Relaxed) != *v {
                e.store(*v, Relaxed);
                written += 1;
            }
        }
        // Entries before the ref / frontend written next (a syscall, itself a full barrier).
        std::sync::atomic::fence(Release);
        Ok(written)
    }
}

/// An in-memory [`MaglevStore`] for the applier's tests.
#[derive(Debug, Clone)]
pub(crate) struct MemMaglev {
    pub table_size: u32,
    pub data: Vec<u32>,
    /// Entries written so far.
    pub writes: usize,
}

impl MemMaglev {
    #[cfg(test)]
    pub fn new(table_size: u32, tables: u32) -> Self {
        MemMaglev {
            table_size,
            data: vec![0; (table_size * tables) as usize],
            writes: 0,
        }
    }
}

impl MaglevStore for MemMaglev {
    fn table_size(&self) -> u32 {
        self.table_size
    }
    fn entries(&self) -> u32 {
        self.data.len() as u32
    }
    fn read(&self, base: u32, len: u32) -> Vec<u32> {
        self.data[base as usize..(base + len) as usize].to_vec()
    }
    fn write(&mut self, base: u32, table: &[u32]) -> Result<usize, TableError> {
        let mut written = 0;
        for (i, v) in table.iter().enumerate() {
            let e = &mut self.data[base as usize + i];
            if *e != *v {
                *e = *v;
                written += 1;
            }
        }
        self.writes += written;
        Ok(written)
    }
}

impl MaglevStore for std::sync::Arc<std::sync::Mutex<MemMaglev>> {
    fn table_size(&self) -> u32 {
        self.lock().expect("poisoned").table_size
    }
    fn entries(&self) -> u32 {
        self.lock().expect("poisoned").entries()
    }
    fn read(&self, base: u32, len: u32) -> Vec<u32> {
        self.lock().expect("poisoned").read(base, len)
    }
    fn write(&mut self, base: u32, table: &[u32]) -> Result<usize, TableError> {
        self.lock().expect("poisoned").write(base, table)
    }
}

/// The frontend filter's words (`KP_FE_FILTER`, see `kproxy_common::frontend_filter`).
pub(crate) trait FilterStore: Send {
    /// Word `i`.
    fn read(&self, i: u32) -> u64;
    /// Makes word `i` hold `value` (one aligned 8-byte store: a reader sees the old or the
    /// new word).
    fn write(&mut self, i: u32, value: u64);
    /// After a batch of writes: they are visible before anything the caller writes next.
    fn publish(&mut self) {}
}

/// [`FilterStore`] on the pinned mmapable array.
pub(crate) struct KernelFilter {
    array: SharedArray,
}

impl KernelFilter {
    pub(crate) fn new(name: &'static str, data: MapData) -> Result<Self, TableError> {
        let (array, words) = SharedArray::new(name, data, 8)?;
        if words != kproxy_common::frontend_filter::FILTER_WORDS {
            return Err(TableError {
                map: name,
                reason: format!(
                    "the pinned map has {words} words, this kproxy uses {}: remove it with \
                     `kproxy cleanup`",
                    kproxy_common::frontend_filter::FILTER_WORDS
                ),
                full: false,
            });
        }
        Ok(KernelFilter { array })
    }
}

impl FilterStore for KernelFilter {
    fn read(&self, i: u32) -> u64 {
        self.array
            .at::<std::sync::atomic::AtomicU64>(i)
            .load(std::sync::atomic::Ordering::Relaxed)
    }
    fn write(&mut self, i: u32, value: u64) {
        self.array
            .at::<std::sync::atomic::AtomicU64>(i)
            .store(value, std::sync::atomic::Ordering::Relaxed);
    }
    fn publish(&mut self) {
        // Before the frontend written next (a syscall, itself a full barrier).
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
    }
}

/// An in-memory [`FilterStore`] for the applier's tests (all words "maybe", like a new map).
#[derive(Debug, Clone)]
pub(crate) struct MemFilter {
    pub words: Vec<u64>,
}

impl Default for MemFilter {
    fn default() -> Self {
        MemFilter {
            words: vec![0; kproxy_common::frontend_filter::FILTER_WORDS as usize],
        }
    }
}

impl FilterStore for MemFilter {
    fn read(&self, i: u32) -> u64 {
        self.words[i as usize]
    }
    fn write(&mut self, i: u32, value: u64) {
        self.words[i as usize] = value;
    }
}

impl FilterStore for std::sync::Arc<std::sync::Mutex<MemFilter>> {
    fn read(&self, i: u32) -> u64 {
        self.lock().expect("poisoned").read(i)
    }
    fn write(&mut self, i: u32, value: u64) {
        self.lock().expect("poisoned").write(i, value)
    }
}
