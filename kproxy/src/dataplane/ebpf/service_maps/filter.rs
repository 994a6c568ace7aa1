//! The agent's side of the frontend filter (`kproxy_common::frontend_filter`): which bits of
//! `KP_FE_FILTER` must say "maybe a frontend here", kept in step with the frontends the
//! applier writes.
//!
//! Per bit, the number of frontends (service-map keys) hashing to it. The applier calls
//! [`FrontendFilter::add`] for every key it is about to write and [`FrontendFilter::flush`]
//! **before** writing them, and [`FrontendFilter::remove`] for every key it deleted (or did not
//! write after all) and `flush` **after**: a bit says "absent" only while no frontend in the
//! map hashes to it, so the programs never skip a frontend that is there. Pure bookkeeping over
//! a [`FilterStore`] (the mmapped array, or memory in tests).

use std::collections::{BTreeSet, HashMap};

use kproxy_common::frontend_filter::{ALL_ABSENT, FILTER_WORDS, filter_slot};
use kproxy_common::service::ServiceKey;

use crate::dataplane::ebpf::service_maps::tables::FilterStore;

/// The bit of `key`: (word, mask).
fn slot(key: &ServiceKey) -> (u32, u64) {
    filter_slot(&key.addr, key.port, key.proto, key.scope)
}

/// What the filter's words must hold, and which differ from the store.
#[derive(Debug)]
pub(crate) struct FrontendFilter {
    /// Frontends hashing to each bit (`word * 64 + bit`); absent: none.
    refs: HashMap<u32, u32>,
    /// The words as they must be.
    words: Vec<u64>,
    /// Words changed since the last flush.
    dirty: BTreeSet<u32>,
}

impl FrontendFilter {
    /// The filter of the frontends `keys` (e.g. the pinned map's entries at start), written
    /// to `store` in full: every word that differs. Returns it and the words written.
    pub(crate) fn new<'a>(
        keys: impl IntoIterator<Item = &'a ServiceKey>,
        store: &mut dyn FilterStore,
    ) -> (Self, usize) {
        let mut f = FrontendFilter {
            refs: HashMap::new(),
            words: vec![ALL_ABSENT; FILTER_WORDS as usize],
            dirty: BTreeSet::new(),
        };
        for k in keys {
            f.add(k);
        }
        f.dirty.clear();
        let mut written = 0;
        for (i, w) in f.words.iter().enumerate() {
            if store.read(i as u32) != *w {
                store.write(i as u32, *w);
                written += 1;
            }
        }
        store.publish();
        (f, written)
    }

    /// Counts `key` as a frontend in the map (about to be written).
    pub(crate) fn add(&mut self, key: &ServiceKey) {
        let (word, mask) = slot(key);
        let n = self.refs.entry(bit(word, mask)).or_default();
        *n += 1;
        if *n == 1 {
            self.words[word as usize] &= !mask;
            self.dirty.insert(word);
        }
    }

    /// Stops counting `key` (deleted from the map, or not written after all). Each removal
    /// must match an earlier [`Self::add`] of the same key.
    pub(crate) fn remove(&mut self, key: &ServiceKey) {
        let (word, mask) = slot(key);
        let b = bit(word, mask);
        let Some(n) = self.refs.get_mut(&b) else {
            debug_assert!(false, "frontend filter: removing an uncounted key");
            return;
        };
        *n -= 1;
        if *n == 0 {
            self.refs.remove(&b);
            self.words[word as usize] |= mask;
            self.dirty.insert(word);
        }
    }

    /// Writes the words changed since the last flush; returns how many.
    pub(crate) fn flush(&mut self, store: &mut dyn FilterStore) -> usize {
        let n = self.dirty.len();
        for word in std::mem::take(&mut self.dirty) {
            store.write(word, self.words[word as usize]);
        }
        if n > 0 {
            store.publish();
        }
        n
    }

    /// Whether a frontend at `key` may be there per the filter (what the programs read).
    #[cfg(test)]
    pub fn maybe(&self, key: &ServiceKey) -> bool {
        let (word, mask) = slot(key);
        self.words[word as usize] & mask == 0
    }

    /// Bits in use (for tests).
    #[cfg(test)]
    pub fn bits_in_use(&self) -> usize {
        self.refs.len()
    }
}

fn bit(word: u32, mask: u64) -> u32 {
    word * 64 + mask.trailing_zeros()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::ebpf::service_maps::tables::MemFilter;
    use kproxy_common::service::{SCOPE_CLUSTER, SCOPE_EXTERNAL, v4_mapped};

    fn key(i: u32, scope: u8) -> ServiceKey {
        ServiceKey {
            addr: v4_mapped((0x0a60_0000 + i).to_be()),
            port: 80u16.to_be(),
            proto: 6,
            scope,
        }
    }

    /// Reads the store as the programs do.
    fn store_says_maybe(store: &MemFilter, k: &ServiceKey) -> bool {
        let (w, m) = slot(k);
        store.words[w as usize] & m == 0
    }

    #[test]
    fn a_fresh_store_is_rewritten_to_absent_except_the_keys() {
        let mut store = MemFilter::default();
        let keys: Vec<ServiceKey> = (0..100).map(|i| key(i, SCOPE_CLUSTER)).collect();
        let (f, written) = FrontendFilter::new(&keys, &mut store);
        assert_eq!(
            written, FILTER_WORDS as usize,
            "a zeroed store differs everywhere"
        );
        for k in &keys {
            assert!(store_says_maybe(&store, k));
            assert!(f.maybe(k));
        }
        let absent = (100..10_100)
            .map(|i| key(i, SCOPE_EXTERNAL))
            .filter(|k| !store_says_maybe(&store, k))
            .count();
        // 100 bits of 2 Mi are set: nearly every other key is absent.
        assert!(absent > 9_900, "{absent}");
        // Same keys again: nothing to write.
        let (_, again) = FrontendFilter::new(&keys, &mut store);
        assert_eq!(again, 0);
    }

    #[test]
    fn a_bit_stays_until_its_last_key_goes() {
        let mut store = MemFilter::default();
        let (mut f, _) = FrontendFilter::new(&[], &mut store);
        let a = key(1, SCOPE_EXTERNAL);
        assert!(!store_says_maybe(&store, &a));
        f.add(&a);
        assert!(!store_says_maybe(&store, &a), "not written before flush");
        assert_eq!(f.flush(&mut store), 1);
        assert!(store_says_maybe(&store, &a));
        // A second key on the same bit (counted twice) keeps it when the first goes.
        f.add(&a);
        f.remove(&a);
        assert_eq!(
            f.flush(&mut store),
            0,
            "count 2 → 1: the word did not change"
        );
        assert!(store_says_maybe(&store, &a));
        f.remove(&a);
        assert_eq!(f.flush(&mut store), 1);
        assert!(!store_says_maybe(&store, &a));
        assert_eq!(f.bits_in_use(), 0);
    }
}
