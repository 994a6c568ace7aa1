//! `kproxy inspect` in the ipvs mode: per service port, the virtual servers on its addresses
//! (and NodePort) and their real servers, from one IPVS listing.

use std::collections::{BTreeSet, HashMap};

use anyhow::Context;

use crate::dataplane::inspect::{Selected, ServiceReport, matches_frontend, sock};
use crate::model::Protocol;

pub(crate) fn view(selected: &Selected, reports: &mut [ServiceReport]) -> anyhow::Result<()> {
    use super::genl::IpvsHandle;
    let mut h = IpvsHandle::open().context("opening IPVS generic netlink")?;
    let services = h.services().context("listing IPVS virtual servers")?;
    // Virtual servers by (protocol, port); each service looks at its ports' only.
    let mut by_port: HashMap<(Protocol, u16), Vec<usize>> = HashMap::new();
    for (i, vs) in services.iter().enumerate() {
        by_port
            .entry((vs.key.protocol, vs.key.port))
            .or_default()
            .push(i);
    }
    for ((_, sp), r) in selected.iter().zip(reports.iter_mut()) {
        let mut mine: BTreeSet<usize> = BTreeSet::new();
        for port in [sp.port, sp.node_port].into_iter().filter(|p| *p != 0) {
            mine.extend(by_port.get(&(sp.protocol, port)).into_iter().flatten());
        }
        for vs in mine.into_iter().map(|i| &services[i]).filter(|vs| {
            vs.key.protocol == sp.protocol && matches_frontend(sp, vs.key.addr, vs.key.port)
        }) {
            r.kernel.push(format!(
                "virtual server {} {} scheduler={}",
                vs.key.protocol.lower(),
                sock(vs.key.addr, vs.key.port),
                vs.scheduler
            ));
            for d in h.destinations(&vs.key).unwrap_or_default() {
                r.kernel.push(format!(
                    "  -> {} weight={} active={} inactive={}",
                    sock(d.addr, d.port),
                    d.weight,
                    d.active_conns,
                    d.inactive_conns
                ));
                let a = sock(d.addr, d.port);
                if !r.kernel_backends.contains(&a) {
                    r.kernel_backends.push(a);
                }
            }
        }
    }
    Ok(())
}
