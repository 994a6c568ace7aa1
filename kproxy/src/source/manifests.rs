//! Standalone source: Services, EndpointSlices and the node's Node from a file or a directory
//! of multi-document YAML (`--manifests PATH`), re-read when anything below PATH changes.
//!
//! Every read produces the complete state, delivered as one [`Delta::Replace`] per kind (the
//! tracker works out what differs). A document that cannot be used is reported with its file
//! and document index and skipped; the rest of the file applies. Hidden entries (names
//! starting with `.`, e.g. a ConfigMap volume's `..data`) are skipped; files are read in name
//! order, recursively, with extensions `.yaml`, `.yml` or `.json`.
//!
//! Changes are seen through inotify (the `notify` crate) with a short debounce, plus a poll
//! every `POLL_INTERVAL` as a fallback for file systems without inotify; a re-read whose
//! content is unchanged sends nothing.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use notify::Watcher;
use serde::Deserialize;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::model::input::{Delta, Event};

/// Fallback re-read interval when no file event arrives.
pub(crate) const POLL_INTERVAL: Duration = Duration::from_secs(5);
/// Wait this long after a file event for more before re-reading (editors write in steps).
const DEBOUNCE: Duration = Duration::from_millis(100);

/// A document that was skipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: document {index}: {reason}")]
pub struct ManifestError {
    pub file: PathBuf,
    /// 0-based index of the YAML document in the file.
    pub index: usize,
    pub reason: String,
}

/// Everything read from the manifests path.
#[derive(Debug, Clone, Default)]
pub struct Manifests {
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<EndpointSlice>,
    /// Every Node found (the source passes on only the one named like this node).
    pub nodes: Vec<Node>,
}

/// The files below `path` that are read, in order.
pub(crate) fn files(path: &Path) -> std::io::Result<Vec<PathBuf>> {
    let meta = std::fs::metadata(path)?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out = vec![];
    let mut entries: Vec<_> = std::fs::read_dir(path)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name();
        if name.to_string_lossy().starts_with('.') {
            continue;
        }
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p)?);
        } else if matches!(
            p.extension().and_then(|x| x.to_str()),
            Some("yaml" | "yml" | "json")
        ) {
            out.push(p);
        }
    }
    Ok(out)
}

/// Reads and parses everything below `path`. I/O errors on `path` itself are returned; a file
/// or document that cannot be used becomes a [`ManifestError`] and the rest is kept.
pub(crate) fn read(path: &Path) -> std::io::Result<(Manifests, Vec<ManifestError>)> {
    let mut m = Manifests::default();
    let mut errors = vec![];
    for file in files(path)? {
        match std::fs::read_to_string(&file) {
            Ok(text) => parse_into(&file, &text, &mut m, &mut errors),
            Err(e) => errors.push(ManifestError {
                file,
                index: 0,
                reason: format!("cannot read: {e}"),
            }),
        }
    }
    Ok((m, errors))
}

/// Parses one file's text (multi-document YAML or JSON) into `m`.
pub fn parse_into(file: &Path, text: &str, m: &mut Manifests, errors: &mut Vec<ManifestError>) {
    for (index, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let err = |reason: String| ManifestError {
            file: file.to_path_buf(),
            index,
            reason,
        };
        let value = match serde_yaml::Value::deserialize(doc) {
            Ok(v) => v,
            Err(e) => {
                errors.push(err(format!("invalid YAML: {e}")));
                // The YAML stream cannot be resumed after a syntax error.
                break;
            }
        };
        if let Err(reason) = add_object(value, m) {
            errors.push(err(reason));
        }
    }
}

fn add_object(value: serde_yaml::Value, m: &mut Manifests) -> Result<(), String> {
    if value.is_null() {
        return Ok(()); // empty document, e.g. a trailing `---`
    }
    let field = |name: &str| value.get(name).and_then(|v| v.as_str()).map(str::to_owned);
    let kind = field("kind").ok_or("missing field `kind`")?;
    let api_version = field("apiVersion").ok_or("missing field `apiVersion`")?;
    match (api_version.as_str(), kind.as_str()) {
        ("v1", "Service") => m.services.push(decode(value, "Service")?),
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            m.endpoint_slices.push(decode(value, "EndpointSlice")?)
        }
        ("v1", "Node") => m.nodes.push(decode(value, "Node")?),
        ("v1", "List") => {
            let items = value
                .get("items")
                .and_then(|i| i.as_sequence())
                .cloned()
                .unwrap_or_default();
            for (i, item) in items.into_iter().enumerate() {
                add_object(item, m).map_err(|e| format!("items[{i}]: {e}"))?;
            }
        }
        (av, k) => {
            return Err(format!(
                "unsupported object {av}/{k}: expected v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Node or v1 List"
            ));
        }
    }
    Ok(())
}

fn decode<T: serde::de::DeserializeOwned>(
    value: serde_yaml::Value,
    kind: &str,
) -> Result<T, String> {
    serde_yaml::from_value(value).map_err(|e| format!("invalid {kind}: {e}"))
}

/// Whether an object passes upstream's label selector
/// `!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless`.
pub(crate) fn selected(meta: &ObjectMeta) -> bool {
    meta.labels.as_ref().is_none_or(|l| {
        !l.contains_key("service.kubernetes.io/service-proxy-name")
            && !l.contains_key("service.kubernetes.io/headless")
    })
}

/// The events one read turns into: a Replace per kind (Node: only the one named `node_name`).
pub fn events(m: Manifests, node_name: &str) -> Vec<Event> {
    let services = m
        .services
        .into_iter()
        .filter(|s| selected(&s.metadata))
        .collect();
    let slices = m
        .endpoint_slices
        .into_iter()
        .filter(|s| selected(&s.metadata))
        .collect();
    let nodes = m
        .nodes
        .into_iter()
        .filter(|n| n.metadata.name.as_deref() == Some(node_name))
        .take(1)
        .collect();
    vec![
        Event::Service(Delta::Replace(services)),
        Event::EndpointSlice(Delta::Replace(slices)),
        Event::Node(Delta::Replace(nodes)),
    ]
}

/// Hash of the bytes of every file (and their names) below `path`: unchanged ⇒ nothing to send.
fn fingerprint(path: &Path) -> u64 {
    let mut h = DefaultHasher::new();
    if let Ok(files) = files(path) {
        for f in files {
            f.hash(&mut h);
            std::fs::read(&f).ok().hash(&mut h);
        }
    }
    h.finish()
}

/// Whether a file event can mean the manifests changed. notify's inotify backend also reports
/// every open and close-without-write (`IN_OPEN`, `IN_CLOSE_NOWRITE`) — our own reads
/// included, so reacting to them re-read everything in a loop, once per debounce interval.
/// A write is still seen: as `Modify`, and as the close after writing.
pub(crate) fn is_change(ev: &notify::Event) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind};
    match ev.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        _ => true,
    }
}

/// Reads `path` now and again after every change, sending the events into `tx` until it closes.
pub(crate) fn spawn(
    path: PathBuf,
    node_name: String,
    tx: mpsc::Sender<Event>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let (wake_tx, mut wake_rx) = mpsc::unbounded_channel::<()>();
        let watcher = {
            let wake_tx = wake_tx.clone();
            notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
                if res.is_ok_and(|ev| is_change(&ev)) {
                    let _ = wake_tx.send(());
                }
            })
        };
        // Watch the parent of a file too: editors and ConfigMap updates replace files by rename.
        let watch_root = if path.is_file() {
            path.parent().map(Path::to_path_buf)
        } else {
            Some(path.clone())
        };
        let _watcher = match (watcher, watch_root) {
            (Ok(mut w), Some(root)) => match w.watch(&root, notify::RecursiveMode::Recursive) {
                Ok(()) => Some(w),
                Err(e) => {
                    warn!(path = %root.display(), error = %e, "cannot watch manifests; polling every {POLL_INTERVAL:?}");
                    None
                }
            },
            (Err(e), _) => {
                warn!(error = %e, "no file watcher; polling every {POLL_INTERVAL:?}");
                None
            }
            (Ok(_), None) => None,
        };
        let mut last: Option<u64> = None;
        loop {
            let fp = fingerprint(&path);
            if last != Some(fp) {
                last = Some(fp);
                let p = path.clone();
                let read = tokio::task::spawn_blocking(move || read(&p))
                    .await
                    .expect("manifest read panicked");
                match read {
                    Ok((m, errors)) => {
                        for e in &errors {
                            warn!(file = %e.file.display(), document = e.index, "manifest skipped: {}", e.reason);
                        }
                        info!(
                            path = %path.display(),
                            services = m.services.len(),
                            endpoint_slices = m.endpoint_slices.len(),
                            nodes = m.nodes.len(),
                            skipped = errors.len(),
                            "manifests read"
                        );
                        for ev in events(m, &node_name) {
                            if tx.send(ev).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(e) => {
                        // Keep the last good state: a missing directory is more likely a
                        // transient swap than an intent to delete every service.
                        warn!(path = %path.display(), error = %e, "cannot read manifests; keeping the last state");
                        last = None;
                    }
                }
            }
            tokio::select! {
                _ = tx.closed() => return,
                w = wake_rx.recv() => {
                    if w.is_none() { return; }
                    tokio::time::sleep(DEBOUNCE).await;
                    while wake_rx.try_recv().is_ok() {}
                    debug!("manifests changed");
                }
                _ = tokio::time::sleep(POLL_INTERVAL) => {}
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Real inotify: reading the manifests (what [`fingerprint`] and [`read`] do) produces no
    /// event [`is_change`] accepts, writing one does. Events of one watch arrive in order, so
    /// the first accepted event must be the write's.
    #[test]
    fn own_reads_are_not_changes_and_writes_are() {
        let dir =
            std::env::temp_dir().join(format!("kproxy-manifests-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("svc.yaml");
        std::fs::write(&file, "kind: Service\n").unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let mut w = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            if let Ok(ev) = res {
                let _ = tx.send(ev);
            }
        })
        .unwrap();
        w.watch(&dir, notify::RecursiveMode::Recursive).unwrap();
        fingerprint(&dir);
        read(&dir).unwrap();
        std::fs::write(dir.join("marker.yaml"), "").unwrap();
        let mut ignored = 0;
        let first = loop {
            let ev = rx
                .recv_timeout(Duration::from_secs(10))
                .expect("the marker's events arrive");
            if is_change(&ev) {
                break ev;
            }
            ignored += 1;
        };
        drop(w);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            first.paths.iter().any(|p| p.ends_with("marker.yaml")),
            "first accepted event is the write, not a read: {first:?}"
        );
        assert!(ignored > 0, "the reads were reported (and ignored)");
    }

    fn parse(text: &str) -> (Manifests, Vec<ManifestError>) {
        let mut m = Manifests::default();
        let mut e = vec![];
        parse_into(Path::new("f.yaml"), text, &mut m, &mut e);
        (m, e)
    }

    const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\nspec:\n  clusterIP: 10.96.0.10\n  ports: [{port: 80}]\n";

    #[test]
    fn multi_document_yaml_with_all_kinds() {
        let text = format!(
            "{SVC}---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-1, namespace: default, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nendpoints: [{{addresses: [10.0.0.1]}}]\nports: [{{port: 8080}}]\n---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-a}}\n---\n"
        );
        let (m, e) = parse(&text);
        assert!(e.is_empty(), "{e:?}");
        assert_eq!(
            (m.services.len(), m.endpoint_slices.len(), m.nodes.len()),
            (1, 1, 1)
        );
        assert_eq!(m.services[0].metadata.name.as_deref(), Some("web"));
    }

    #[test]
    fn bad_documents_are_reported_with_index_and_the_rest_applies() {
        let text = format!(
            "{SVC}---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: x}}\n---\napiVersion: v1\nkind: Service\nmetadata: {{name: bad}}\nspec: {{ports: 7}}\n---\nkind: Service\n---\n{}",
            SVC.replace("web", "api")
        );
        let (m, e) = parse(&text);
        let names: Vec<_> = m
            .services
            .iter()
            .map(|s| s.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["web", "api"]);
        let idx: Vec<_> = e.iter().map(|e| e.index).collect();
        assert_eq!(idx, [1, 2, 3], "{e:?}");
        assert!(e[0].reason.contains("v1/ConfigMap"), "{}", e[0].reason);
        assert!(e[1].reason.contains("invalid Service"), "{}", e[1].reason);
        assert!(e[2].reason.contains("apiVersion"), "{}", e[2].reason);
        assert!(e[0].to_string().starts_with("f.yaml: document 1: "));
    }

    #[test]
    fn yaml_syntax_error_keeps_earlier_documents() {
        let (m, e) = parse(&format!("{SVC}---\nfoo: [unclosed\n"));
        assert_eq!(m.services.len(), 1);
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].index, 1);
        assert!(e[0].reason.contains("invalid YAML"));
    }

    #[test]
    fn list_items_are_read() {
        let text = format!("apiVersion: v1\nkind: List\nitems:\n{}", {
            let mut s = String::new();
            for n in ["a", "b"] {
                s.push_str(&format!(
                    "- apiVersion: v1\n  kind: Service\n  metadata: {{name: {n}, namespace: ns}}\n"
                ));
            }
            s
        });
        let (m, e) = parse(&text);
        assert!(e.is_empty(), "{e:?}");
        assert_eq!(m.services.len(), 2);
    }

    #[test]
    fn events_apply_the_label_selector_and_pick_this_node() {
        let (mut m, _) = parse(&format!(
            "{SVC}---\napiVersion: v1\nkind: Service\nmetadata: {{name: other, namespace: default, labels: {{service.kubernetes.io/service-proxy-name: foo}}}}\n---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-a}}\n---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-b}}\n"
        ));
        m.endpoint_slices.clear();
        let evs = events(m, "node-b");
        match &evs[0] {
            Event::Service(Delta::Replace(s)) => {
                assert_eq!(s.len(), 1);
                assert_eq!(s[0].metadata.name.as_deref(), Some("web"));
            }
            e => panic!("unexpected {e:?}"),
        }
        match &evs[2] {
            Event::Node(Delta::Replace(n)) => {
                assert_eq!(n.len(), 1);
                assert_eq!(n[0].metadata.name.as_deref(), Some("node-b"));
            }
            e => panic!("unexpected {e:?}"),
        }
    }

    #[test]
    fn directory_files_in_name_order_skipping_hidden_and_other_extensions() {
        // Unique per run (pid and clock): another test process, possibly in another pid
        // namespace, never shares it.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir =
            std::env::temp_dir().join(format!("kproxy-manifests-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::create_dir_all(dir.join("..data")).unwrap();
        std::fs::write(dir.join("b.yaml"), SVC.replace("web", "b")).unwrap();
        std::fs::write(dir.join("a.yml"), SVC.replace("web", "a")).unwrap();
        std::fs::write(
            dir.join("sub/c.json"),
            r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"c"}}"#,
        )
        .unwrap();
        std::fs::write(dir.join("notes.txt"), "kind: Service").unwrap();
        std::fs::write(dir.join("..data/d.yaml"), SVC.replace("web", "d")).unwrap();
        let (m, e) = read(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(e.is_empty(), "{e:?}");
        let names: Vec<_> = m
            .services
            .iter()
            .map(|s| s.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["a", "b", "c"]);
    }
}
