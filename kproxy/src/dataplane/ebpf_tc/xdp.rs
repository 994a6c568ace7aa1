//! [`XdpPath`]: the XDP program of the node-device service path (`kp_xdp`,
//! `kproxy-ebpf/src/xdp.rs`), attached beside the TC programs per `--bpf-xdp`
//! ([`XdpPolicy`]). It only ever drops what TC would drop (source-range denials, frontends
//! without endpoints that drop rather than reject), earlier; every other packet is passed to
//! TC, so a device without XDP loses nothing but the early drop.
//!
//! Links are not pinned: they live as long as the agent's object instance. A restarted agent
//! attaches again (between the two, TC alone handles the traffic, with the same result). The
//! NodePort/LB forwarding fast path for remote backends (XDP_TX / XDP_REDIRECT) is not
//! implemented: such packets go through TC.

use std::collections::BTreeMap;

use aya::Ebpf;
use aya::maps::PerCpuArray;
use aya::programs::{Xdp, XdpMode, xdp::XdpLinkId};
use kproxy_common::ct::{MAP_XDP_STATS, PROG_XDP, XdpStat};

use super::TcError;

/// Where the XDP program is attached (`bpf.xdp` / `--bpf-xdp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XdpPolicy {
    /// TC only.
    Off,
    /// Native (driver) XDP where the driver supports it; elsewhere TC alone, with a warning.
    BestEffort,
    /// Native XDP on every device; a device that cannot take it is an error.
    Native,
}

/// The XDP program of one loaded object and the devices it is attached to.
pub struct XdpPath {
    attached: BTreeMap<String, XdpLinkId>,
}

pub(crate) fn program(ebpf: &mut Ebpf) -> Result<&mut Xdp, TcError> {
    ebpf.program_mut(PROG_XDP)
        .ok_or(TcError::MissingProgram(PROG_XDP))?
        .try_into()
        .map_err(|error| TcError::Program {
            name: PROG_XDP,
            error,
        })
}

impl XdpPath {
    /// Loads `kp_xdp` from `ebpf` (the TC path's object instance, sharing its pinned maps).
    pub fn load(ebpf: &mut Ebpf) -> Result<XdpPath, TcError> {
        let prog = program(ebpf)?;
        if prog.fd().is_err() {
            prog.load().map_err(|error| TcError::Program {
                name: PROG_XDP,
                error,
            })?;
        }
        Ok(XdpPath {
            attached: BTreeMap::new(),
        })
    }

    /// Attaches to `device` (in the calling thread's network namespace) as `policy` says.
    /// Returns whether the program is attached there.
    pub fn attach(
        &mut self,
        ebpf: &mut Ebpf,
        device: &str,
        policy: XdpPolicy,
    ) -> Result<bool, TcError> {
        if policy == XdpPolicy::Off {
            return Ok(false);
        }
        if self.attached.contains_key(device) {
            return Ok(true);
        }
        match program(ebpf)?.attach(device, XdpMode::Driver) {
            Ok(id) => {
                self.attached.insert(device.to_string(), id);
                tracing::info!(device, "XDP early drop attached (native)");
                Ok(true)
            }
            Err(e) if policy == XdpPolicy::BestEffort => {
                tracing::warn!(device, error = %e, "no native XDP on this device: TC only");
                Ok(false)
            }
            Err(e) => Err(TcError::Attach {
                name: PROG_XDP,
                device: device.to_string(),
                error: format!("native XDP (bpf.xdp native): {e}"),
            }),
        }
    }

    /// Detaches from `device`.
    pub fn detach(&mut self, ebpf: &mut Ebpf, device: &str) -> Result<(), TcError> {
        if let Some(id) = self.attached.remove(device) {
            program(ebpf)?
                .detach(id)
                .map_err(|error| TcError::Program {
                    name: PROG_XDP,
                    error,
                })?;
        }
        Ok(())
    }

    /// Devices the program is attached to.
    pub fn attached(&self) -> Vec<String> {
        self.attached.keys().cloned().collect()
    }

    /// The program's counters, summed over CPUs.
    pub fn stats(ebpf: &Ebpf) -> Result<BTreeMap<&'static str, u64>, TcError> {
        let name = MAP_XDP_STATS;
        let map = ebpf.map(name).ok_or(TcError::MissingMap(name))?;
        let array = PerCpuArray::<_, u64>::try_from(map).map_err(TcError::map(name))?;
        let mut out = BTreeMap::new();
        for s in XdpStat::ALL {
            let v = array.get(&s.index(), 0).map_err(TcError::map(name))?;
            out.insert(stat_name(s), v.iter().sum());
        }
        Ok(out)
    }
}

/// The metric-style name of a counter.
pub fn stat_name(s: XdpStat) -> &'static str {
    match s {
        XdpStat::SourceRangeDrop => "source_range_drop",
        XdpStat::NoEndpointsDrop => "no_endpoints_drop",
        XdpStat::NewFlow => "new_flow",
        XdpStat::Forward => "forward",
        XdpStat::Reply => "reply",
        XdpStat::PassLocal => "pass_local",
        XdpStat::PassFib => "pass_fib",
        XdpStat::PassMtu => "pass_mtu",
        XdpStat::PassHeader => "pass_header",
        XdpStat::PassState => "pass_state",
    }
}
