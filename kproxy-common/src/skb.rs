//! What the TC programs read of the kernel's `struct sk_buff` beyond `__sk_buff`: the
//! checksum state `ip_summed`, which decides whether an L4 checksum can be updated in place
//! (see `kproxy-ebpf/src/skb_csum.rs`).
//!
//! `__sk_buff` does not expose `ip_summed`, and its place in `struct sk_buff` differs between
//! kernel builds. The programs therefore read it through the `bpf_cast_to_kern_ctx` kfunc (the
//! verifier inlines it to a register move) with four fixed instructions whose kfunc id, field
//! offset and bit shift are placeholders. Before loading, the agent completes them from the
//! running kernel's BTF (`kproxy::bpf::object`), or, when the kernel lacks BTF or the kfunc,
//! replaces them with instructions that yield [`CHECKSUM_COMPLETE`] (the programs then use the
//! checksum helpers, which are right for every state). The instructions are defined here once:
//! the BPF side emits them verbatim, the agent finds and patches exactly these values.

/// `ip_summed` values (`include/linux/skbuff.h`).
pub const CHECKSUM_NONE: u8 = 0;
pub const CHECKSUM_UNNECESSARY: u8 = 1;
pub const CHECKSUM_COMPLETE: u8 = 2;
pub const CHECKSUM_PARTIAL: u8 = 3;

/// The kfunc the programs call: `void *bpf_cast_to_kern_ctx(void *ctx)` (kernel ≥ 6.3).
pub const KFUNC_CAST_TO_KERN_CTX: &str = "bpf_cast_to_kern_ctx";
/// The kernel struct and member read.
pub const SKB_STRUCT: &str = "sk_buff";
pub const SKB_IP_SUMMED: &str = "ip_summed";

const KFUNC_ID_PLACEHOLDER: i32 = 0x7ead_0001;
const IP_SUMMED_OFF_PLACEHOLDER: i16 = 0x7ead;
const IP_SUMMED_SHIFT_PLACEHOLDER: i32 = 0x7eae;

/// One BPF instruction as the little-endian `u64` it is stored as (`struct bpf_insn`).
pub const fn insn(code: u8, regs: u8, off: i16, imm: i32) -> u64 {
    code as u64 | (regs as u64) << 8 | (off as u16 as u64) << 16 | (imm as u32 as u64) << 32
}

/// `call kfunc` (`BPF_JMP | BPF_CALL`, src `BPF_PSEUDO_KFUNC_CALL`, vmlinux BTF id `id`):
/// `r0 = kfunc(r1)`.
pub const fn call_kfunc(id: i32) -> u64 {
    insn(0x85, 0x20, 0, id)
}
/// `r0 = *(u8 *)(r0 + off)`.
pub const fn load_byte_r0(off: i16) -> u64 {
    insn(0x71, 0x00, off, 0)
}
/// `r0 >>= n`.
pub const fn shift_r0(n: i32) -> u64 {
    insn(0x77, 0x00, 0, n)
}
/// `r0 = imm`.
pub const fn mov_r0(imm: i32) -> u64 {
    insn(0xb7, 0x00, 0, imm)
}
/// `r0 &= 3` (`ip_summed` is two bits wide).
pub const MASK_IP_SUMMED: u64 = insn(0x57, 0x00, 0, 3);

/// The placeholder instructions, in program order (the fourth, [`MASK_IP_SUMMED`], is final).
pub const CALL_PLACEHOLDER: u64 = call_kfunc(KFUNC_ID_PLACEHOLDER);
pub const LOAD_PLACEHOLDER: u64 = load_byte_r0(IP_SUMMED_OFF_PLACEHOLDER);
pub const SHIFT_PLACEHOLDER: u64 = shift_r0(IP_SUMMED_SHIFT_PLACEHOLDER);

/// What completes the placeholders: the kfunc's BTF id and the byte offset and bit shift of
/// `ip_summed` in `struct sk_buff`; `None` yields [`CHECKSUM_COMPLETE`] (helpers only).
pub const fn completed(site: Option<(i32, i16, i32)>) -> [u64; 3] {
    match site {
        Some((id, off, shift)) => [call_kfunc(id), load_byte_r0(off), shift_r0(shift)],
        None => [mov_r0(0), mov_r0(CHECKSUM_COMPLETE as i32), shift_r0(0)],
    }
}
