//! `kproxy render` output: the snapshot a set of manifests describes, as JSON or as a table.
//!
//! For now both forms show the mode-independent snapshot (service ports and endpoints as the
//! datapaths receive them); the per-mode rule/map dumps come with the datapaths.

use std::fmt::Write as _;

use crate::model::Snapshot;

/// The snapshot as pretty JSON.
pub fn json(snap: &Snapshot) -> String {
    serde_json::to_string_pretty(snap).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

/// One line per service port: name, protocol, frontends, endpoints (`*` = ready and local to
/// this node, `(t)` = terminating, `(!)` = not ready).
pub fn table(snap: &Snapshot) -> String {
    let mut rows = vec![[
        "SERVICE PORT".to_owned(),
        "PROTO".to_owned(),
        "FRONTENDS".to_owned(),
        "ENDPOINTS".to_owned(),
    ]];
    for (name, svc) in &snap.services {
        let mut fronts: Vec<String> = svc
            .cluster_ips
            .iter()
            .map(|ip| std::net::SocketAddr::new(*ip, svc.port).to_string())
            .collect();
        if svc.node_port != 0 {
            fronts.push(format!("nodePort {}", svc.node_port));
        }
        fronts.extend(svc.external_ips.iter().map(|ip| format!("external {ip}")));
        fronts.extend(
            svc.load_balancer_ingress
                .iter()
                .map(|i| format!("lb {}", i.ip)),
        );
        let eps: Vec<String> = snap
            .endpoints_of(name)
            .iter()
            .map(|e| {
                let mut s = e.addr();
                if e.is_local {
                    s.push('*');
                }
                if e.terminating {
                    s.push_str("(t)");
                } else if !e.ready {
                    s.push_str("(!)");
                }
                s
            })
            .collect();
        rows.push([
            name.to_string(),
            name.protocol.to_string(),
            fronts.join(" "),
            if eps.is_empty() {
                "-".into()
            } else {
                eps.join(" ")
            },
        ]);
    }
    let widths: Vec<usize> = (0..4)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in &rows {
        let line = format!(
            "{:w0$}  {:w1$}  {:w2$}  {}",
            r[0],
            r[1],
            r[2],
            r[3],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2]
        );
        let _ = writeln!(out, "{}", line.trim_end());
    }
    let _ = writeln!(
        out,
        "({} service ports; * = endpoint on node {:?})",
        snap.services.len(),
        snap.node.name
    );
    out
}
