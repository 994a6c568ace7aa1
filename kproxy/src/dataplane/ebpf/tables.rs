//! One map as the applier sees it: dump, put, delete, capacity. [`KernelTable`] is a pinned
//! BPF map (aya); [`MemTable`] is an in-memory stand-in with the same capacity rules, used by
//! the applier's unit tests (no root needed).

use std::collections::BTreeMap;

use aya::Pod;
use aya::maps::lpm_trie::{Key as LpmKey, LpmTrie};
use aya::maps::{HashMap, Map, MapData, MapError};
use kproxy_common::service::SourceRangeKey;

use super::planner::SourceRangeEntry;

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
    fn name(&self) -> &'static str;
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
pub struct KernelTable<K: Pod, V: Pod> {
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
    pub fn new(name: &'static str, data: MapData) -> Result<Self, TableError> {
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
    fn name(&self) -> &'static str {
        self.name
    }
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
pub struct KernelLpmTable {
    name: &'static str,
    map: LpmTrie<MapData, SourceRangeKey, u8>,
    capacity: u32,
}

impl KernelLpmTable {
    pub fn new(name: &'static str, data: MapData) -> Result<Self, TableError> {
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
    fn name(&self) -> &'static str {
        self.name
    }
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
pub struct MemTable<K: Ord, V> {
    pub name: &'static str,
    pub entries: BTreeMap<K, V>,
    pub capacity: u32,
    /// Count of successful puts (tests assert the applier writes only what changed).
    pub writes: usize,
}

impl<K: Ord, V> MemTable<K, V> {
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
    fn name(&self) -> &'static str {
        self.name
    }
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
pub type SharedMem<K, V> = std::sync::Arc<std::sync::Mutex<MemTable<K, V>>>;

impl<K: Ord + Clone + Send, V: Clone + Send> Table<K, V> for SharedMem<K, V> {
    fn name(&self) -> &'static str {
        self.lock().expect("poisoned").name
    }
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
