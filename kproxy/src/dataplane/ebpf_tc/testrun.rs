//! `BPF_PROG_TEST_RUN` of the TC programs: run `kp_tc_in` / `kp_tc_eg` once (or `repeat`
//! times) on a crafted Ethernet frame and get the verdict and the rewritten frame. Used by the
//! crafted-packet tests and by `cargo xtask bench` (program names: `kproxy_common::ct::
//! PROG_TC_INGRESS` / `PROG_TC_EGRESS`; the cases worth timing are a new flow, an established
//! flow, a miss (not a service) and a reverse NAT, see `tests/tests/ebpf/ebpf_tc_testrun.rs` for
//! how to build each). The skb of a test run has ifindex 1 (`lo`) and CHECKSUM_NONE, so the
//! SNAT source used is `KP_NODE_ADDR4[1]`.

use std::time::Duration;

use aya::Ebpf;
use aya::programs::{TestRun, TestRunOptions};

use super::TcError;
use super::attach::classifier;

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

/// Runs `program` (must be loaded, see [`super::TcPath::load`]) `repeat` times on `frame`.
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

/// Runs the XDP program `kp_xdp` (loaded, see [`super::xdp::XdpPath::load`]) `repeat` times
/// on `frame`; the verdict is the `XDP_*` action (1 drop, 2 pass).
pub fn run_xdp(ebpf: &mut Ebpf, frame: &[u8], repeat: u32) -> Result<TestRunOutcome, TcError> {
    let prog = super::xdp::program(ebpf)?;
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
