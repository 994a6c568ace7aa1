//! Kernel side of the eBPF datapath: bpffs, the object with its pinned maps, and the socket-LB
//! programs attached to a cgroup through pinned links.
//!
//! Layout under `<bpffs>/kproxy/`:
//! - `<MAP NAME>`: every map of the object that is declared pinned (the service maps, and the
//!   TC maps of the same object), created on first start and reused afterwards;
//! - `links/<program>`: one pinned `bpf_link` per socket-LB program (`kproxy_common::sock::
//!   PROGRAMS`: the eight `sock_addr` hooks and `sock_release`). A link that is already
//!   pinned is kept as it is (same link id, no detach/attach gap), so a restarted agent (even
//!   after kill -9) neither interrupts nor re-attaches; the programs behind those links read
//!   the same pinned maps, which the new agent reconciles. A program without a pinned link
//!   (pins of a build that did not have it, such as `kp_sk_release` over pins from before it
//!   existed) is attached beside the reused ones, which stay attached throughout.
//!
//! Before loading, [`crate::dataplane::ebpf::layout::reconcile`] makes every pinned map this build's layout
//! (reused, carried over or replaced, recorded in `KP_LAYOUT`; socket-LB links of a previous
//! layout are dropped). A map whose `max_entries` differs from `--bpf-map-sizes` keeps its old
//! size (warning). A pinned link keeps the program of the agent that created it; upgrading the programs means
//! `kproxy cleanup` (which removes the pins) and a start. The link's cgroup is not compared
//! with `--bpf-cgroup` on reuse.
//!
//! The Maglev maps are the exception: their size follows the mode and table size
//! (`tables × M` ids in maglev mode, one element in random mode), so pinned ones of another size
//! are removed before the load and created anew (the TC programs still attached keep the old
//! ones until they are replaced; frontends carrying `SVC_F_MAGLEV` fall back to a random slot
//! until the first sync writes the new tables).

use std::fs;
use std::path::{Path, PathBuf};

use aya::Ebpf;
use aya::maps::MapData;
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::{CgroupAttachMode, Program};
use kproxy_common::ct::MAP_CT;
use kproxy_common::ct6::MAP_CT6;
use kproxy_common::frontend_filter::MAP_FRONTEND_FILTER;
use kproxy_common::maglev::{
    DEFAULT_MAGLEV_ENTRIES, DEFAULT_MAGLEV_REF_MAX, MAP_MAGLEV, MAP_MAGLEV_REF, maglev_elems,
};
use kproxy_common::service::{
    MAP_AFFINITY, MAP_BACKEND_SLOTS, MAP_BACKENDS, MAP_SERVICES, MAP_SOCK_FWD, MAP_SOCK_REV_NAT,
    MAP_SOCK_SENT, MAP_SOURCE_RANGES,
};
use kproxy_common::sock;

use super::apply::Tables;
use super::tables::{KernelFilter, KernelLpmTable, KernelMaglev, KernelTable, TableError};
use super::{LbAlgorithm, ServiceMapsConfig};
use crate::dataplane::ebpf::object::{self, BpfError, LoadOptions, error_chain};
use crate::dataplane::ebpf::pins::{BpffsError, ensure_bpffs, link_dir, pin_dir, remove_pins};
use crate::dataplane::ebpf::socket_lb::cgroup::cgroup2_root;

/// Errors of setting up the eBPF datapath.
#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    #[error(transparent)]
    Bpf(#[from] BpfError),
    #[error("bpffs at {path}: {reason}")]
    Bpffs { path: PathBuf, reason: String },
    #[error(transparent)]
    BpffsMount(#[from] BpffsError),
    #[error("cgroup {path}: {reason}")]
    Cgroup { path: PathBuf, reason: String },
    #[error("socket-LB program {name}: {reason}")]
    Program { name: &'static str, reason: String },
    #[error(transparent)]
    Table(#[from] TableError),
    #[error(transparent)]
    Layout(#[from] crate::dataplane::ebpf::layout::LayoutError),
}

/// The loaded object, its pin directory and the ids of the socket-LB links.
pub(crate) struct Kernel {
    _ebpf: Ebpf,
    pin_dir: PathBuf,
    /// `(program, link id)` of each attached socket-LB program.
    pub links: Vec<(&'static str, u32)>,
    /// What was done with the maps pinned by a previous agent.
    pub layout: crate::dataplane::ebpf::layout::LayoutReport,
}

/// Loads the object (reusing pinned maps), returns the service tables and attaches socket LB.
pub(crate) fn load(cfg: &ServiceMapsConfig) -> Result<(Kernel, Tables), LoaderError> {
    if !object::is_built() {
        return Err(BpfError::NotBuilt.into());
    }
    ensure_bpffs(&cfg.bpffs)?;
    let dir = pin_dir(&cfg.bpffs);
    fs::create_dir_all(link_dir(&dir)).map_err(|e| LoaderError::Bpffs {
        path: dir.clone(),
        reason: format!("creating {}: {e}", link_dir(&dir).display()),
    })?;
    let sock_links: Vec<PathBuf> = sock::PROGRAMS
        .iter()
        .map(|p| link_dir(&dir).join(p))
        .collect();
    let layout = crate::dataplane::ebpf::layout::reconcile(&dir, &sock_links)?;
    let sizes = &cfg.map_sizes;
    let (maglev_entries, maglev_refs) = maglev_sizes(cfg);
    recreate_maglev_if_resized(&dir, maglev_entries)?;
    let mut ebpf = object::load(&LoadOptions {
        pin_dir: Some(&dir),
        max_entries: vec![
            (MAP_SERVICES, sizes.services),
            (MAP_BACKEND_SLOTS, sizes.backend_slots),
            (MAP_BACKENDS, sizes.backends),
            (MAP_AFFINITY, sizes.affinity),
            (MAP_SOURCE_RANGES, sizes.source_ranges),
            (MAP_SOCK_REV_NAT, sizes.sock_rev_nat),
            (MAP_SOCK_FWD, sizes.sock_rev_nat),
            (MAP_SOCK_SENT, sizes.sock_rev_nat),
            (MAP_CT, sizes.ct),
            (MAP_CT6, sizes.ct),
            (MAP_MAGLEV, maglev_entries),
            (MAP_MAGLEV_REF, maglev_refs),
        ],
    })?;

    // Owned handles on the pinned maps, independent of the object's own map table.
    let take = |name: &'static str| -> Result<MapData, LoaderError> {
        if ebpf.map(name).is_none() {
            return Err(BpfError::MissingMap { name }.into());
        }
        MapData::from_pin(dir.join(name)).map_err(|e| {
            LoaderError::Table(TableError {
                map: name,
                reason: format!("opening the pinned map: {e}"),
                full: false,
            })
        })
    };
    let tables = Tables {
        services: Box::new(KernelTable::new(MAP_SERVICES, take(MAP_SERVICES)?)?),
        slots: Box::new(KernelTable::new(
            MAP_BACKEND_SLOTS,
            take(MAP_BACKEND_SLOTS)?,
        )?),
        backends: Box::new(KernelTable::new(MAP_BACKENDS, take(MAP_BACKENDS)?)?),
        source_ranges: Box::new(KernelLpmTable::new(
            MAP_SOURCE_RANGES,
            take(MAP_SOURCE_RANGES)?,
        )?),
        affinity: Box::new(KernelTable::new(MAP_AFFINITY, take(MAP_AFFINITY)?)?),
        maglev_refs: Box::new(KernelTable::new(MAP_MAGLEV_REF, take(MAP_MAGLEV_REF)?)?),
        maglev: Box::new(KernelMaglev::new(
            MAP_MAGLEV,
            take(MAP_MAGLEV)?,
            cfg.maglev_table_size,
        )?),
        filter: Box::new(KernelFilter::new(
            MAP_FRONTEND_FILTER,
            take(MAP_FRONTEND_FILTER)?,
        )?),
    };

    for (name, have, want) in [
        (MAP_SERVICES, tables.services.capacity(), sizes.services),
        (
            MAP_BACKEND_SLOTS,
            tables.slots.capacity(),
            sizes.backend_slots,
        ),
        (MAP_BACKENDS, tables.backends.capacity(), sizes.backends),
        (
            MAP_SOURCE_RANGES,
            tables.source_ranges.capacity(),
            sizes.source_ranges,
        ),
        (MAP_AFFINITY, tables.affinity.capacity(), sizes.affinity),
    ] {
        if have != want {
            tracing::warn!(
                map = name,
                pinned = have,
                configured = want,
                "reusing the pinned map with its old size; `kproxy cleanup` and a restart apply \
                 the new one"
            );
        }
    }

    let links = if cfg.socket_lb {
        attach_sock(&mut ebpf, cfg, &dir)?
    } else {
        Vec::new()
    };
    Ok((
        Kernel {
            _ebpf: ebpf,
            pin_dir: dir,
            links,
            layout,
        },
        tables,
    ))
}

/// `max_entries` of `KP_MAGLEV` and `KP_MAGLEV_REF`: `⌈tables × M / 2⌉` and `tables` in maglev
/// mode, the compiled defaults in random mode.
pub(crate) fn maglev_sizes(cfg: &ServiceMapsConfig) -> (u32, u32) {
    match cfg.lb_algorithm {
        LbAlgorithm::Maglev => (
            maglev_elems(cfg.map_sizes.maglev.saturating_mul(cfg.maglev_table_size)),
            cfg.map_sizes.maglev.max(1),
        ),
        LbAlgorithm::Random => (DEFAULT_MAGLEV_ENTRIES, DEFAULT_MAGLEV_REF_MAX),
    }
}

/// Removes the pinned Maglev maps when the table array's size is not `entries` (see the
/// module docs).
fn recreate_maglev_if_resized(dir: &Path, entries: u32) -> Result<(), LoaderError> {
    let pin = dir.join(MAP_MAGLEV);
    if !pin.exists() {
        return Ok(());
    }
    let have = MapData::from_pin(&pin)
        .and_then(|m| m.info())
        .map(|i| i.max_entries())
        .map_err(|e| {
            LoaderError::Table(TableError {
                map: MAP_MAGLEV,
                reason: format!("opening the pinned map: {e}"),
                full: false,
            })
        })?;
    if have == entries {
        return Ok(());
    }
    tracing::info!(
        pinned = have,
        configured = entries,
        "Maglev table array resized: recreating {MAP_MAGLEV} and {MAP_MAGLEV_REF}"
    );
    for name in [MAP_MAGLEV, MAP_MAGLEV_REF] {
        let p = dir.join(name);
        if p.exists() {
            fs::remove_file(&p).map_err(|e| LoaderError::Bpffs {
                path: p.clone(),
                reason: format!("removing: {e}"),
            })?;
        }
    }
    Ok(())
}

fn attach_sock(
    ebpf: &mut Ebpf,
    cfg: &ServiceMapsConfig,
    dir: &Path,
) -> Result<Vec<(&'static str, u32)>, LoaderError> {
    let cgroup_path = match &cfg.cgroup {
        Some(p) => p.clone(),
        None => cgroup2_root().ok_or_else(|| LoaderError::Cgroup {
            path: PathBuf::from("/proc/self/mountinfo"),
            reason: "no cgroup2 mount found (pass --bpf-cgroup)".into(),
        })?,
    };
    let mut links = Vec::new();
    for name in sock::PROGRAMS {
        let perr = |reason: String| LoaderError::Program { name, reason };
        let pin = link_dir(dir).join(name);
        if pin.exists() {
            let pinned = PinnedLink::from_pin(&pin)
                .map_err(|e| perr(format!("reusing pinned link {}: {e}", pin.display())))?;
            let fd: FdLink = pinned.into();
            let id = fd.info().map_err(|e| perr(e.to_string()))?.id();
            tracing::debug!(program = name, link = id, "reusing pinned link");
            links.push((name, id));
            continue;
        }
        let cgroup = fs::File::open(&cgroup_path).map_err(|e| LoaderError::Cgroup {
            path: cgroup_path.clone(),
            reason: e.to_string(),
        })?;
        let fd = attach_link(ebpf, name, &cgroup).map_err(|e| match e {
            AttachError::Missing => LoaderError::from(BpfError::MissingProgram { name }),
            AttachError::Attach(reason) => {
                perr(format!("attaching to {}: {reason}", cgroup_path.display()))
            }
            AttachError::Other(reason) => perr(reason),
        })?;
        let id = fd.info().map_err(|e| perr(e.to_string()))?.id();
        fd.pin(&pin)
            .map_err(|e| perr(format!("pinning the link at {}: {e}", pin.display())))?;
        tracing::info!(program = name, link = id, cgroup = %cgroup_path.display(), "attached");
        links.push((name, id));
    }
    Ok(links)
}

/// Why [`attach_link`] failed.
enum AttachError {
    Missing,
    Attach(String),
    Other(String),
}

/// Loads socket-LB program `name` if it is not yet and attaches it to `cgroup` through a new
/// link: the `sock_addr` programs and the `sock_release` one (`CgroupSock`).
fn attach_link(ebpf: &mut Ebpf, name: &str, cgroup: &fs::File) -> Result<FdLink, AttachError> {
    // The two program types have the same calls but no common trait.
    macro_rules! attach {
        ($program:expr) => {{
            let program = $program;
            if program.fd().is_err() {
                program
                    .load()
                    .map_err(|e| AttachError::Other(format!("loading: {}", error_chain(&e))))?;
            }
            let link_id = program
                // bpf_link_create takes no flags for cgroups (links always coexist with others).
                .attach(cgroup, CgroupAttachMode::Single)
                .map_err(|e| AttachError::Attach(error_chain(&e)))?;
            let link = program
                .take_link(link_id)
                .map_err(|e| AttachError::Other(e.to_string()))?;
            FdLink::try_from(link).map_err(|e| AttachError::Other(e.to_string()))
        }};
    }
    match ebpf.program_mut(name).ok_or(AttachError::Missing)? {
        Program::CgroupSockAddr(p) => attach!(p),
        Program::CgroupSock(p) => attach!(p),
        other => Err(AttachError::Other(format!(
            "unexpected program type {:?}",
            other.prog_type()
        ))),
    }
}

impl Kernel {
    /// Detaches socket LB (removes the link pins) and removes the pinned maps.
    pub(crate) fn cleanup(&self) -> std::io::Result<()> {
        remove_pins(&self.pin_dir)
    }
}
