//! The kernel [`NftBackend`]: transactions through `nft -f -` (one `nft` run per transaction,
//! atomic like knftables' `Run`), the table's chains, sets and elements read back with
//! `nft -j list …`.
//!
//! **Known gap (issue #19):** the kernel state is read by parsing `nft -j` (JSON) output, not
//! through netlink. Upstream moved away from `nft list table` because it took 40 s at 44k
//! services; kproxy never lists the whole table (no rules are printed): a sync reads
//! `nft -t -j list chains <family>`, `list sets` and `list maps` once (terse: names without
//! elements; cached until the next transaction), and a full sync additionally one
//! `nft -j list set|map` per element storage (six sets/maps), like knftables' `List` and
//! `ListElements`. The netlink reader is left for later.
//!
//! The JSON → element text conversion ([`element_text`]) is pure and gives exactly the text
//! the planner writes (`172.30.0.41 . tcp . 80`, `goto service-…`, `drop`), so the element
//! storages compare kernel content with planned content key by key.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

use super::proxier::NftBackend;
use super::setup::TABLE;
use super::transaction::Transaction;

/// Runs `nft`, in a network namespace when `netns` is set (`nsenter --net=<path>`).
#[derive(Debug, Clone, Default)]
pub struct NftRunner {
    pub netns: Option<PathBuf>,
}

impl NftRunner {
    fn command(&self) -> Command {
        crate::dataplane::netfilter::exec::command(self.netns.as_deref(), "nft")
    }

    /// Runs `nft args` with `stdin`; `Ok(stdout)` on success, `Err(stderr)` otherwise.
    pub fn run(&self, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
        let mut c = self.command();
        c.args(args);
        let out = crate::dataplane::netfilter::exec::run(c, stdin)
            .map_err(|e| format!("running nft: {e}"))?;
        if out.success {
            Ok(out.stdout)
        } else {
            Err(out.stderr.trim().to_string())
        }
    }
}

/// Chains and sets (name → is a map) of the table, as last read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Listing {
    chains: Vec<String>,
    sets: BTreeMap<String, bool>,
}

/// The kernel's `<family> kube-proxy` table.
#[derive(Debug, Clone)]
pub struct KernelTable {
    pub family: String,
    pub runner: NftRunner,
    /// What `list chains/sets/maps` gave; dropped by every transaction.
    listing: Option<Listing>,
    /// `nft` invocations so far (reads and transactions).
    pub nft_runs: u64,
}

impl KernelTable {
    pub fn new(family: &str, runner: NftRunner) -> Self {
        KernelTable {
            family: family.into(),
            runner,
            listing: None,
            nft_runs: 0,
        }
    }

    fn nft(&mut self, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
        self.nft_runs += 1;
        self.runner.run(args, stdin)
    }

    /// `nft -t -j list <what> <family>`: terse (`-t`), so sets and maps come without their
    /// elements (names are all a listing needs).
    fn list_json(&mut self, what: &str) -> Result<Value, String> {
        let fam = self.family.clone();
        let out = self
            .nft(&["-t", "-j", "list", what, &fam], None)
            .map_err(|e| format!("nft list {what} {fam}: {e}"))?;
        serde_json::from_str(&out).map_err(|e| format!("nft list {what} {fam}: bad JSON: {e}"))
    }

    fn listing(&mut self) -> Result<&Listing, String> {
        if self.listing.is_none() {
            let chains = self.list_json("chains")?;
            let sets = self.list_json("sets")?;
            let maps = self.list_json("maps")?;
            self.listing = Some(Listing {
                chains: objects_of(&chains, "chain")
                    .filter_map(|c| c["name"].as_str().map(str::to_string))
                    .collect(),
                sets: objects_of(&sets, "set")
                    .map(|s| (s, false))
                    .chain(objects_of(&maps, "map").map(|m| (m, true)))
                    .filter_map(|(s, m)| s["name"].as_str().map(|n| (n.to_string(), m)))
                    .collect(),
            });
        }
        Ok(self.listing.as_ref().expect("just read"))
    }

    /// Deletes the table if it exists (cleanup).
    pub fn delete_table(&mut self) -> Result<(), String> {
        self.listing = None;
        let fam = self.family.clone();
        match self.nft(&["delete", "table", &fam, TABLE], None) {
            Ok(_) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(format!("nft delete table {fam} {TABLE}: {e}")),
        }
    }
}

/// The kernel's "no such object" answer.
fn is_not_found(stderr: &str) -> bool {
    stderr.contains("No such file or directory")
}

/// The objects of kind `kind` in `nft -j` output that belong to the kube-proxy table.
fn objects_of<'a>(v: &'a Value, kind: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    v["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(move |o| o.get(kind))
        .filter(|o| o["table"].as_str() == Some(TABLE))
}

impl NftBackend for KernelTable {
    fn list_chains(&mut self) -> Result<Vec<String>, String> {
        Ok(self.listing()?.chains.clone())
    }

    /// Sets only, not maps (knftables `List("sets")`, like [`super::FakeTable::list_sets`]).
    fn list_sets(&mut self) -> Result<Vec<String>, String> {
        Ok(self
            .listing()?
            .sets
            .iter()
            .filter(|(_, is_map)| !**is_map)
            .map(|(n, _)| n.clone())
            .collect())
    }

    fn list_elements(&mut self, set: &str) -> Result<Vec<(String, Option<String>)>, String> {
        let Some(&is_map) = self.listing()?.sets.get(set) else {
            return Ok(vec![]);
        };
        let fam = self.family.clone();
        let kind = if is_map { "map" } else { "set" };
        let out = match self.nft(&["-j", "list", kind, &fam, TABLE, set], None) {
            Ok(out) => out,
            Err(e) if is_not_found(&e) => return Ok(vec![]),
            Err(e) => return Err(format!("nft list {kind} {fam} {TABLE} {set}: {e}")),
        };
        let v: Value = serde_json::from_str(&out)
            .map_err(|e| format!("nft list {kind} {set}: bad JSON: {e}"))?;
        let Some(obj) = objects_of(&v, kind).find(|o| o["name"].as_str() == Some(set)) else {
            return Ok(vec![]);
        };
        elements_of(obj).map_err(|e| format!("{kind} {set}: {e}"))
    }

    fn run(&mut self, tx: &Transaction) -> Result<(), String> {
        if tx.ops.is_empty() {
            return Ok(());
        }
        self.listing = None;
        self.nft(&["-f", "-"], Some(&tx.to_string())).map(|_| ())
    }
}

/// The elements of one `set`/`map` JSON object as (key, value) texts.
pub fn elements_of(obj: &Value) -> Result<Vec<(String, Option<String>)>, String> {
    let mut out = vec![];
    for e in obj["elem"].as_array().into_iter().flatten() {
        match e.as_array() {
            Some(kv) if kv.len() == 2 => {
                out.push((element_text(&kv[0])?, Some(verdict_text(&kv[1])?)));
            }
            _ => out.push((element_text(e)?, None)),
        }
    }
    Ok(out)
}

/// One key in the planner's text form: `a . b . c` for concatenations, `addr/len`
/// for prefixes, `a-b` for ranges; an element's comment is dropped.
pub fn element_text(v: &Value) -> Result<String, String> {
    Ok(match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Object(o) => {
            if let Some(e) = o.get("elem") {
                element_text(&e["val"])?
            } else if let Some(parts) = o.get("concat").and_then(Value::as_array) {
                parts
                    .iter()
                    .map(element_text)
                    .collect::<Result<Vec<_>, _>>()?
                    .join(" . ")
            } else if let Some(p) = o.get("prefix") {
                format!("{}/{}", element_text(&p["addr"])?, element_text(&p["len"])?)
            } else if let Some(r) = o.get("range").and_then(Value::as_array) {
                let [a, b] = r.as_slice() else {
                    return Err(format!("bad range {v}"));
                };
                format!("{}-{}", element_text(a)?, element_text(b)?)
            } else {
                return Err(format!("unknown element form {v}"));
            }
        }
        other => return Err(format!("unknown element form {other}")),
    })
}

/// A verdict map value in the planner's text form (`goto chain`, `jump chain`, `drop`, …).
pub fn verdict_text(v: &Value) -> Result<String, String> {
    let Some((verb, arg)) = v.as_object().and_then(|o| o.iter().next()) else {
        return Err(format!("unknown verdict {v}"));
    };
    Ok(match arg.get("target").and_then(Value::as_str) {
        Some(target) => format!("{verb} {target}"),
        None => verb.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn map_elements_read_back_as_the_planner_writes_them() {
        let obj = json!({
            "name": "no-endpoint-services", "table": "kube-proxy", "map": "verdict",
            "elem": [
                [{"concat": ["172.30.0.41", "tcp", 80]}, {"goto": {"target": "service-X/ns/s/tcp/p"}}],
                [{"elem": {"val": {"concat": ["fd00::1", "udp", 53]}, "comment": "ns/s:p"}}, {"drop": null}],
            ]
        });
        assert_eq!(
            elements_of(&obj).unwrap(),
            vec![
                (
                    "172.30.0.41 . tcp . 80".to_string(),
                    Some("goto service-X/ns/s/tcp/p".to_string())
                ),
                ("fd00::1 . udp . 53".to_string(), Some("drop".to_string())),
            ]
        );
    }

    #[test]
    fn set_elements_prefixes_and_ranges() {
        let obj = json!({"elem": [
            "10.0.0.1",
            {"prefix": {"addr": "10.1.0.0", "len": 16}},
            {"range": ["10.2.0.1", "10.2.0.9"]},
        ]});
        let keys: Vec<String> = elements_of(&obj)
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(keys, ["10.0.0.1", "10.1.0.0/16", "10.2.0.1-10.2.0.9"]);
        assert!(element_text(&json!(["x"])).is_err());
        assert_eq!(elements_of(&json!({"name": "empty"})).unwrap(), vec![]);
    }

    #[test]
    fn objects_of_other_tables_are_ignored() {
        let v = json!({"nftables": [
            {"metainfo": {}},
            {"chain": {"table": "kube-proxy", "name": "services"}},
            {"chain": {"table": "filter", "name": "input"}},
        ]});
        let names: Vec<&str> = objects_of(&v, "chain")
            .filter_map(|c| c["name"].as_str())
            .collect();
        assert_eq!(names, ["services"]);
    }
}
