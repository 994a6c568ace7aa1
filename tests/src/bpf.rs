//! BPF tools for tests and benchmarks, kept out of the agent: the per-CPU packet counter
//! ([`PacketCounter`], programs `kproxy_common::counter`, from the tools' object
//! `kproxy::dataplane::ebpf::object::load_tools`) and `BPF_PROG_TEST_RUN` of the node
//! path's programs ([`testrun`]).
//!
//! Attaching resolves the interface in the calling thread's network namespace (tests switch a
//! dedicated thread with `setns`); the links live as long as the owning [`aya::Ebpf`].

use aya::Ebpf;
use aya::maps::PerCpuArray;
use aya::programs::{SchedClassifier, TcAttachType, Xdp, XdpMode};
use kproxy::dataplane::ebpf::object::{self, BpfError, LoadOptions};
pub use kproxy_common::counter::{CounterSlot, MAP_PACKET_COUNT, PacketCount};

/// The per-CPU packet counter (`kproxy_common::counter`): attach it to interfaces at XDP, TC
/// ingress or TC egress and read what it counted. Dropping it detaches everything.
pub struct PacketCounter {
    ebpf: Ebpf,
}

impl PacketCounter {
    /// Loads the object and the three counter programs into the kernel.
    pub fn load() -> Result<Self, BpfError> {
        Self::from_ebpf(object::load_tools(&LoadOptions::default())?)
    }

    /// Like [`PacketCounter::load`], with the object's pinned maps in `map_pin_dir`.
    pub fn load_with_pins(map_pin_dir: &std::path::Path) -> Result<Self, BpfError> {
        Self::from_ebpf(object::load_tools(&LoadOptions {
            pin_dir: Some(map_pin_dir),
            ..Default::default()
        })?)
    }

    /// Uses an already loaded object (e.g. one with pinning options); loads the programs.
    pub fn from_ebpf(mut ebpf: Ebpf) -> Result<Self, BpfError> {
        if ebpf.map(MAP_PACKET_COUNT).is_none() {
            return Err(BpfError::MissingMap {
                name: MAP_PACKET_COUNT,
            });
        }
        for slot in CounterSlot::ALL {
            let name = slot.program();
            let program = ebpf
                .program_mut(name)
                .ok_or(BpfError::MissingProgram { name })?;
            let loaded = match slot {
                CounterSlot::Xdp => <&mut Xdp>::try_from(program).and_then(|p| p.load()),
                CounterSlot::TcIngress | CounterSlot::TcEgress => {
                    <&mut SchedClassifier>::try_from(program).and_then(|p| p.load())
                }
            };
            loaded.map_err(|error| BpfError::Program { name, error })?;
        }
        Ok(PacketCounter { ebpf })
    }

    /// Attaches the program of `slot` to `interface` (in the calling thread's network
    /// namespace): XDP in the driver's default mode, TC through TCX on kernels >= 6.6.
    pub fn attach(&mut self, interface: &str, slot: CounterSlot) -> Result<(), BpfError> {
        let name = slot.program();
        let program = self
            .ebpf
            .program_mut(name)
            .ok_or(BpfError::MissingProgram { name })?;
        let attach_error = |error| BpfError::Attach {
            name,
            interface: interface.to_string(),
            error,
        };
        match slot {
            CounterSlot::Xdp => {
                let xdp = <&mut Xdp>::try_from(program).map_err(attach_error)?;
                xdp.attach(interface, XdpMode::Default)
                    .map_err(attach_error)?;
            }
            CounterSlot::TcIngress | CounterSlot::TcEgress => {
                let tc = <&mut SchedClassifier>::try_from(program).map_err(attach_error)?;
                let point = if slot == CounterSlot::TcIngress {
                    TcAttachType::Ingress
                } else {
                    TcAttachType::Egress
                };
                tc.attach(interface, point).map_err(attach_error)?;
            }
        }
        Ok(())
    }

    /// What `slot` counted so far, summed over all CPUs (and over every interface it is
    /// attached to).
    pub fn count(&self, slot: CounterSlot) -> Result<PacketCount, BpfError> {
        let name = MAP_PACKET_COUNT;
        let map = self.ebpf.map(name).ok_or(BpfError::MissingMap { name })?;
        let array = PerCpuArray::<_, PacketCount>::try_from(map)
            .map_err(|error| BpfError::Map { name, error })?;
        let per_cpu = array
            .get(&slot.index(), 0)
            .map_err(|error| BpfError::Map { name, error })?;
        Ok(per_cpu
            .iter()
            .fold(PacketCount::default(), |sum, c| sum.saturating_add(*c)))
    }

    /// The sum over every slot.
    pub fn total(&self) -> Result<PacketCount, BpfError> {
        CounterSlot::ALL
            .into_iter()
            .try_fold(PacketCount::default(), |sum, slot| {
                Ok(sum.saturating_add(self.count(slot)?))
            })
    }

    /// The underlying object, e.g. for `BPF_PROG_TEST_RUN` on [`CounterSlot::program`].
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }
}

/// `BPF_PROG_TEST_RUN` of the TC programs: run `kp_tc_in` / `kp_tc_eg` once (or `repeat`
/// times) on a crafted Ethernet frame and get the verdict and the rewritten frame. Used by the
/// crafted-packet tests and by `cargo xtask bench` (program names: `kproxy_common::ct::
/// PROG_TC_INGRESS` / `PROG_TC_EGRESS`; the cases worth timing are a new flow, an established
/// flow, a miss (not a service) and a reverse NAT, see `tests/tests/ebpf/ebpf_tc_testrun.rs` for
/// how to build each). The skb of a test run has ifindex 1 (`lo`) and CHECKSUM_NONE, so the
/// SNAT source used is `KP_NODE_ADDR4[1]`.
pub mod testrun {
    use std::time::Duration;

    use aya::Ebpf;
    use aya::programs::{TestRun, TestRunOptions};
    use kproxy::dataplane::ebpf::node_path::TcError;
    use kproxy::dataplane::ebpf::node_path::tc::classifier;
    use kproxy::dataplane::ebpf::node_path::xdp;

    /// What one run returned.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct TestRunOutcome {
        /// The program's return value (`TC_ACT_*` as i32: -1 next, 2 drop, 7 redirect).
        pub verdict: i32,
        /// The frame after the program (its length may differ from the input's).
        pub frame: Vec<u8>,
        /// Average run time per repetition.
        pub duration: Duration,
    }

    /// Runs `program` (must be loaded, see [`kproxy::dataplane::ebpf::node_path::TcPath::load`]) `repeat` times on `frame`.
    pub fn run(
        ebpf: &mut Ebpf,
        program: &'static str,
        frame: &[u8],
        repeat: u32,
    ) -> Result<TestRunOutcome, TcError> {
        let prog = classifier(ebpf, program)?;
        let mut out = vec![0u8; frame.len() + 256];
        let opts = TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            repeat: repeat.max(1),
            ..TestRunOptions::default()
        };
        let result = prog.test_run(opts).map_err(|error| TcError::Program {
            name: program,
            error,
        })?;
        out.truncate(result.data_size_out as usize);
        Ok(TestRunOutcome {
            verdict: result.return_value as i32,
            frame: out,
            duration: result.duration,
        })
    }

    /// Runs the XDP program `kp_xdp` (loaded, see [`kproxy::dataplane::ebpf::node_path::xdp::XdpPath::load`]) `repeat` times
    /// on `frame`; the verdict is the `XDP_*` action (1 drop, 2 pass).
    pub fn run_xdp(ebpf: &mut Ebpf, frame: &[u8], repeat: u32) -> Result<TestRunOutcome, TcError> {
        let prog = xdp::program(ebpf)?;
        let mut out = vec![0u8; frame.len() + 256];
        let opts = TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            repeat: repeat.max(1),
            ..TestRunOptions::default()
        };
        let result = prog.test_run(opts).map_err(|error| TcError::Program {
            name: kproxy_common::ct::PROG_XDP,
            error,
        })?;
        out.truncate(result.data_size_out as usize);
        Ok(TestRunOutcome {
            verdict: result.return_value as i32,
            frame: out,
            duration: result.duration,
        })
    }
}
