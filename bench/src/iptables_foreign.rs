//! `iptables-foreign`: the iptables agent beside another program's nat rule (issue #29). Cold
//! start (agent exec → the last service answers) with N services × 5 endpoints and one
//! endpoint change (API write → a connection reaches the new backend), each with one foreign
//! nat rule in the node (Docker's masquerade rule, `-A POSTROUTING -s 172.17.0.0/16 !
//! -o docker0 -j MASQUERADE`, added before the agent starts) and without (the baseline), per
//! iptables backend, in interleaved rounds (clean, foreign, clean, …) so both see the same
//! machine. After each foreign round the rule must still be there, unchanged.
//!
//! Figures: `cold-start-foreign/<mode>/<n>` against `cold-start-clean/<mode>/<n>` (s), and
//! `change-foreign/<mode>/<n>` against `change-clean/<mode>/<n>` (ms, every change of every
//! round). Runs in a full run or when `--only` names it.

use std::time::Duration;

use anyhow::Context as _;

use kproxy_tests::netns::Netns;
use kproxy_tests::topology::TopologySpec;

use super::agent::{AgentSpec, ScratchDir, Source, check_backend, iptables_backend};
use super::control::{NetnsApi, changes};
use super::services::ServiceSet;
use super::{Figure, Plan, Results};

/// The group's name (`--only`).
pub const GROUP: &str = "iptables-foreign";

/// Rounds per backend and variant.
pub const ROUNDS: usize = 3;

/// The foreign rule (Docker's), as `iptables -t nat` arguments and as `iptables-save` prints it.
const FOREIGN_ARGS: [&str; 9] = [
    "-A",
    "POSTROUTING",
    "-s",
    "172.17.0.0/16",
    "!",
    "-o",
    "docker0",
    "-j",
    "MASQUERADE",
];
const FOREIGN_SAVED: &str = "-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE";

/// Changes per round: the plan's changes spread over the rounds (at least 5).
pub fn changes_per_round(plan: &Plan) -> u32 {
    (plan.changes / ROUNDS as u32).max(5)
}

pub fn run(plan: &Plan, results: &mut Results) -> anyhow::Result<()> {
    let n = plan.cold_services;
    for mode in plan.modes.iter().filter(|m| iptables_backend(m).is_some()) {
        let mut cold = [vec![], vec![]];
        let mut change = [vec![], vec![]];
        let mut failed = None;
        'rounds: for _ in 0..ROUNDS {
            for (v, foreign) in [false, true].into_iter().enumerate() {
                match round(plan, mode, foreign) {
                    Ok((c, ch)) => {
                        cold[v].push(c);
                        change[v].extend(ch);
                    }
                    Err(e) => {
                        failed = Some(format!("{e:#}"));
                        break 'rounds;
                    }
                }
            }
        }
        if let Some(e) = failed {
            for what in ["cold-start", "change"] {
                for v in ["clean", "foreign"] {
                    results.unavailable(format!("{what}-{v}/{mode}/{n}"), &e);
                }
            }
            continue;
        }
        for (what, unit, samples) in [("cold-start", "s", cold), ("change", "ms", change)] {
            let [clean, foreign] = samples;
            for (v, samples) in [("clean", clean), ("foreign", foreign)] {
                results.push(Figure {
                    id: format!("{what}-{v}/{mode}/{n}"),
                    group: GROUP.into(),
                    mode: mode.clone(),
                    services: n,
                    unit: unit.into(),
                    samples,
                    baseline: (v == "foreign").then(|| format!("{what}-clean/{mode}/{n}")),
                    target: None,
                });
            }
        }
    }
    Ok(())
}

fn nat_save(node: &Netns, backend: &str) -> anyhow::Result<String> {
    let mut save = node.command(format!("iptables-{backend}-save"));
    save.args(["-t", "nat"]);
    kproxy_tests::netns::run_checked(&mut save)
}

/// One cold start and its changes, in a fresh topology: (cold start s, changes ms).
fn round(plan: &Plan, mode: &str, foreign: bool) -> anyhow::Result<(f64, Vec<f64>)> {
    let backend = iptables_backend(mode).context("not an iptables mode")?;
    let n = plan.cold_services;
    let mut topo = TopologySpec::new(&format!("bench-fr-{backend}"))
        .local_pods(3)
        .build()?;
    topo.pod_mut("pod-l1").serve(&[])?;
    topo.pod_mut("pod-l2").serve(&[])?;
    let (l1, l2) = (topo.pod("pod-l1").ip, topo.pod("pod-l2").ip);
    let set = ServiceSet {
        count: n,
        endpoints_per_service: 5,
        target_backends: vec![l1],
        node_ip: kproxy_tests::topology::NODE_IP,
    };
    let server = NetnsApi::start(&topo.node)?;
    set.create_all(&server.api)?;
    let scratch = ScratchDir::new("bench-fr")?;
    let kubeconfig = scratch.path().join("kubeconfig");
    server.api.write_kubeconfig(&kubeconfig)?;
    if foreign {
        let mut add = topo.node.command(format!("iptables-{backend}"));
        add.args(["-w", "5", "-t", "nat"]).args(FOREIGN_ARGS);
        kproxy_tests::netns::run_checked(&mut add).context("adding the foreign rule")?;
    }
    let spec = AgentSpec {
        mode,
        node: &topo.node,
        source: Source::Kubeconfig(kubeconfig),
        cgroup: None,
        bpffs: None,
        log: scratch.path().join("agent.log"),
    };
    let client = &topo.pod("pod-l0").ns;
    let vip = set.target_addr();
    let mut agent = spec.start()?;
    let answered = agent
        .wait_answer(client, None, &vip, Some("pod-l1"), Duration::from_secs(600))
        .map_err(anyhow::Error::msg)?;
    let cold = answered.duration_since(agent.started)?.as_secs_f64();
    check_backend(&topo.node, backend)?;
    let round_plan = Plan {
        changes: changes_per_round(plan),
        ..plan.clone()
    };
    let ch = changes(
        &round_plan,
        &set,
        &server.api,
        &mut agent,
        client,
        None,
        &vip,
        (l1, l2),
    )?;
    drop(agent);
    let nat = nat_save(&topo.node, backend)?;
    anyhow::ensure!(
        nat.lines().filter(|l| *l == FOREIGN_SAVED).count() == usize::from(foreign),
        "the foreign rule after the round (foreign: {foreign}): {}",
        nat.lines()
            .filter(|l| l.starts_with("-A POSTROUTING"))
            .collect::<Vec<_>>()
            .join("; ")
    );
    Ok((cold, ch))
}
