//! [`VecMap`]: a small ordered map kept as a sorted `Vec`.
//!
//! For the many tiny maps kept per service (a service port's frontends, the claimants of a
//! frontend, the slices of a service): a `BTreeMap` or `BTreeSet` allocates a whole B-tree
//! leaf for its first entry (11 slots, ≈ 0.3–0.9 KB), ≈ 3–9 MB per such map at 10k services;
//! here an entry costs its own size. The first four inserts grow the Vec one slot at a time.
//! Lookups are binary searches; inserts shift, which is fine at these sizes and wrong for big
//! maps.

use std::borrow::Borrow;
use std::ops::Index;

/// An ordered map backed by a `Vec` sorted by key (unique keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VecMap<K, V> {
    entries: Vec<(K, V)>,
}

impl<K, V> Default for VecMap<K, V> {
    fn default() -> Self {
        VecMap {
            entries: Vec::new(),
        }
    }
}

impl<K: Ord, V> VecMap<K, V> {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    fn position<Q: Ord + ?Sized>(&self, key: &Q) -> Result<usize, usize>
    where
        K: Borrow<Q>,
    {
        self.entries.binary_search_by(|(k, _)| k.borrow().cmp(key))
    }

    /// Inserts or replaces; returns the previous value.
    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<V> {
        match self.position(&key) {
            Ok(i) => Some(std::mem::replace(&mut self.entries[i].1, value)),
            Err(i) => {
                self.grow();
                self.entries.insert(i, (key, value));
                None
            }
        }
    }

    /// Inserts `value` unless `key` is present (the first value wins); returns whether it
    /// inserted.
    pub(crate) fn insert_if_absent(&mut self, key: K, value: V) -> bool {
        match self.position(&key) {
            Ok(_) => false,
            Err(i) => {
                self.grow();
                self.entries.insert(i, (key, value));
                true
            }
        }
    }

    /// Room for one more entry: exact up to four, then doubling.
    fn grow(&mut self) {
        let len = self.entries.len();
        if len == self.entries.capacity() {
            self.entries.reserve_exact(if len < 4 { 1 } else { len });
        }
    }

    pub(crate) fn get<Q: Ord + ?Sized>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.position(key).ok().map(|i| &self.entries[i].1)
    }

    pub fn contains_key<Q: Ord + ?Sized>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
    {
        self.position(key).is_ok()
    }

    pub(crate) fn remove<Q: Ord + ?Sized>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        self.position(key).ok().map(|i| self.entries.remove(i).1)
    }
}

impl<K, V> VecMap<K, V> {
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// Entries in key order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> + Clone {
        self.entries.iter().map(|(k, v)| (k, v))
    }
    pub(crate) fn keys(&self) -> impl Iterator<Item = &K> + Clone {
        self.entries.iter().map(|(k, _)| k)
    }
    pub fn values(&self) -> impl Iterator<Item = &V> + Clone {
        self.entries.iter().map(|(_, v)| v)
    }
    /// Drops spare capacity (for maps kept long after they are built).
    pub fn shrink_to_fit(&mut self) {
        self.entries.shrink_to_fit();
    }
}

impl<K: Ord, V, Q: Ord + ?Sized> Index<&Q> for VecMap<K, V>
where
    K: Borrow<Q>,
{
    type Output = V;
    fn index(&self, key: &Q) -> &V {
        self.get(key).expect("key not in VecMap")
    }
}

impl<K: Ord, V> FromIterator<(K, V)> for VecMap<K, V> {
    /// Later duplicates replace earlier ones, as with `BTreeMap`.
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut m = VecMap::new();
        for (k, v) in iter {
            m.insert(k, v);
        }
        m
    }
}

impl<'a, K, V> IntoIterator for &'a VecMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = std::iter::Map<std::slice::Iter<'a, (K, V)>, fn(&'a (K, V)) -> (&'a K, &'a V)>;
    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter().map(|(k, v)| (k, v))
    }
}

#[cfg(test)]
mod tests {
    use super::VecMap;

    #[test]
    fn keeps_keys_sorted_and_unique() {
        let mut m = VecMap::new();
        assert_eq!(m.insert(3, "c"), None);
        assert_eq!(m.insert(1, "a"), None);
        assert_eq!(m.insert(2, "b"), None);
        assert_eq!(m.insert(2, "B"), Some("b"));
        assert!(!m.insert_if_absent(1, "x"));
        assert!(m.insert_if_absent(0, "z"));
        assert_eq!(m.keys().copied().collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(m[&2], "B");
        assert_eq!(m.get(&7), None);
        assert!(m.contains_key(&3));
        assert_eq!(m.remove(&3), Some("c"));
        assert_eq!(m.len(), 3);
        // Four distinct keys were inserted: exactly four slots (a default Vec has 4 too, but
        // after one insert it would already hold 4).
        assert_eq!(m.entries.capacity(), 4);
        let mut one = VecMap::new();
        one.insert("k", ());
        assert_eq!(
            one.entries.capacity(),
            1,
            "small maps grow one slot at a time"
        );
        let collected: VecMap<_, _> = [(5, 1), (4, 2), (5, 3)].into_iter().collect();
        assert_eq!(collected.iter().collect::<Vec<_>>(), [(&4, &2), (&5, &3)]);
    }
}
