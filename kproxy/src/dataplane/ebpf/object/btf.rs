//! A minimal reader of the kernel's BTF (`/sys/kernel/btf/vmlinux`): the two facts the BPF
//! object needs completed before loading (`kproxy_common::skb`) — the BTF id of a kernel
//! function and the bit position of a struct member, looked up through anonymous
//! struct/union members as C does. aya 0.14 parses BTF but does not expose struct members.
//!
//! Format: `Documentation/bpf/btf.rst` (header, type section, string section; native byte
//! order; type ids start at 1).

use std::path::Path;

/// The kernel's BTF.
pub(crate) const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

const MAGIC: u16 = 0xeb9f;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_FUNC: u32 = 12;

/// Errors of reading BTF.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BtfError {
    #[error("reading {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("malformed BTF: {0}")]
    Malformed(&'static str),
    #[error("BTF kind {kind} of type {id} is unknown")]
    UnknownKind { kind: u32, id: u32 },
}

/// One member of a struct or union.
#[derive(Debug, Clone, Copy)]
struct Member {
    name: u32,
    ty: u32,
    /// Bit offset from the start of the enclosing type.
    bit_offset: u32,
    /// 0: not a bitfield.
    bitfield_size: u32,
}

/// BTF indexed by type id: the raw bytes and where each type's record starts. Records are
/// decoded when a lookup reads them (the kernel's BTF has ≈ 100k types; materialising all of
/// them with their members cost ≈ 10 MB at agent start-up for two lookups).
pub(crate) struct Btf {
    bytes: Vec<u8>,
    /// The type and string sections: (start, end) in `bytes`.
    types: (usize, usize),
    strings: (usize, usize),
    /// Offset in the type section of type `id`'s record, at index `id - 1`.
    records: Vec<u32>,
}

/// Where a member lies: bit offset from the start of the outer struct, and width in bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemberBits {
    pub bit_offset: u32,
    pub bits: u32,
}

fn u32_at(b: &[u8], off: usize) -> Result<u32, BtfError> {
    b.get(off..off + 4)
        .map(|s| u32::from_ne_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or(BtfError::Malformed("truncated"))
}

/// A record's fields: name offset, kind, member count (`vlen`), kind flag.
fn header(t: &[u8], at: usize) -> Result<(u32, u32, usize, u32), BtfError> {
    let info = u32_at(t, at + 4)?;
    Ok((
        u32_at(t, at)?,
        (info >> 24) & 0x1f,
        (info & 0xffff) as usize,
        info >> 31,
    ))
}

impl Btf {
    /// Reads and parses the BTF at `path`.
    pub(crate) fn read(path: &Path) -> Result<Btf, BtfError> {
        let bytes = std::fs::read(path).map_err(|error| BtfError::Read {
            path: path.display().to_string(),
            error,
        })?;
        Btf::parse(bytes)
    }

    /// Parses raw BTF (a `.BTF` section or `/sys/kernel/btf/vmlinux`): checks the header and
    /// every record's extent, and indexes the records.
    pub(crate) fn parse(bytes: impl Into<Vec<u8>>) -> Result<Btf, BtfError> {
        let b: Vec<u8> = bytes.into();
        if b.len() < 24 || u16::from_ne_bytes([b[0], b[1]]) != MAGIC {
            return Err(BtfError::Malformed("bad magic"));
        }
        let hdr_len = u32_at(&b, 4)? as usize;
        let (type_off, type_len) = (u32_at(&b, 8)? as usize, u32_at(&b, 12)? as usize);
        let (str_off, str_len) = (u32_at(&b, 16)? as usize, u32_at(&b, 20)? as usize);
        let section = |off: usize, len: usize| {
            let start = hdr_len + off;
            (start + len <= b.len())
                .then_some((start, start + len))
                .ok_or(BtfError::Malformed("section out of bounds"))
        };
        let types = section(type_off, type_len)?;
        let strings = section(str_off, str_len)?;
        let t = &b[types.0..types.1];
        let mut records = Vec::new();
        let mut pos = 0usize;
        while pos < t.len() {
            let id = records.len() as u32 + 1;
            let (_, kind, vlen, _) = header(t, pos)?;
            records.push(pos as u32);
            pos += 12;
            pos += match kind {
                // INT: one u32; ARRAY: 12 bytes; VAR and DECL_TAG: one u32.
                1 | 14 | 17 => 4,
                3 => 12,
                // STRUCT, UNION, DATASEC, ENUM64: 12 bytes per entry; ENUM, FUNC_PROTO: 8.
                KIND_STRUCT | KIND_UNION | 15 | 19 => vlen * 12,
                6 | 13 => vlen * 8,
                // PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FLOAT, TYPE_TAG.
                2 | 7..=12 | 16 | 18 => 0,
                kind => return Err(BtfError::UnknownKind { kind, id }),
            };
        }
        if pos != t.len() {
            return Err(BtfError::Malformed("type section overrun"));
        }
        Ok(Btf {
            bytes: b,
            types,
            strings,
            records,
        })
    }

    fn type_section(&self) -> &[u8] {
        &self.bytes[self.types.0..self.types.1]
    }

    fn name(&self, off: u32) -> &[u8] {
        let s = &self.bytes[self.strings.0..self.strings.1];
        let s = s.get(off as usize..).unwrap_or_default();
        &s[..s.iter().position(|&c| c == 0).unwrap_or(s.len())]
    }

    /// Type `id`'s record offset, name offset and kind.
    fn record(&self, id: u32) -> Option<(usize, u32, u32)> {
        let at = *self.records.get((id as usize).checked_sub(1)?)? as usize;
        let (name, kind, _, _) = header(self.type_section(), at).ok()?;
        Some((at, name, kind))
    }

    /// The members of the struct or union whose record is at `at`.
    fn members(&self, at: usize) -> impl Iterator<Item = Member> + '_ {
        let t = self.type_section();
        let (_, _, vlen, kind_flag) = header(t, at).unwrap_or((0, 0, 0, 0));
        (0..vlen).filter_map(move |m| {
            let at = at + 12 + m * 12;
            let offset = u32_at(t, at + 8).ok()?;
            let (bit_offset, bitfield_size) = if kind_flag == 1 {
                (offset & 0x00ff_ffff, offset >> 24)
            } else {
                (offset, 0)
            };
            Some(Member {
                name: u32_at(t, at).ok()?,
                ty: u32_at(t, at + 4).ok()?,
                bit_offset,
                bitfield_size,
            })
        })
    }

    fn find(&self, name: &str, kind: u32) -> Option<(u32, usize)> {
        (1..=self.records.len() as u32).find_map(|id| {
            let (at, n, k) = self.record(id)?;
            (k == kind && self.name(n) == name.as_bytes()).then_some((id, at))
        })
    }

    /// The id of the function `name` (BTF kind FUNC).
    pub(crate) fn func_id(&self, name: &str) -> Option<u32> {
        self.find(name, KIND_FUNC).map(|(id, _)| id)
    }

    /// Where member `member` of struct `strukt` lies, found directly or inside anonymous
    /// struct/union members (C's anonymous member access).
    pub(crate) fn member_bits(&self, strukt: &str, member: &str) -> Option<MemberBits> {
        let (_, at) = self.find(strukt, KIND_STRUCT)?;
        self.member_in(at, member.as_bytes(), 0, 0)
    }

    fn member_in(&self, at: usize, member: &[u8], base: u32, depth: u32) -> Option<MemberBits> {
        for m in self.members(at) {
            if m.name != 0 {
                if self.name(m.name) == member {
                    return Some(MemberBits {
                        bit_offset: base + m.bit_offset,
                        bits: m.bitfield_size,
                    });
                }
                continue;
            }
            // Anonymous: a struct or union whose members belong to the outer type.
            let (inner, _, kind) = self.record(m.ty)?;
            if depth < 8
                && (kind == KIND_STRUCT || kind == KIND_UNION)
                && let Some(found) = self.member_in(inner, member, base + m.bit_offset, depth + 1)
            {
                return Some(found);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// BTF with `struct outer { int a; union { struct { u8 x:3, y:2; }; }; }` and a FUNC `f`.
    fn sample() -> Vec<u8> {
        let strings = b"\0int\0outer\0a\0x\0y\0f\0".to_vec();
        let (int, outer, a, x, y, f) = (1u32, 5, 11, 13, 15, 17);
        let mut t: Vec<u32> = Vec::new();
        // [1] INT "int" size 4, encoding word.
        t.extend([int, 1 << 24, 4, 32]);
        // [2] STRUCT (anon) with bitfields x (bit 0, 3 bits), y (bit 3, 2 bits); kind_flag.
        t.extend([0, (1 << 31) | (4 << 24) | 2, 1]);
        t.extend([x, 1, 3 << 24]);
        t.extend([y, 1, (2 << 24) | 3]);
        // [3] UNION (anon) holding [2].
        t.extend([0, (5 << 24) | 1, 1]);
        t.extend([0, 2, 0]);
        // [4] STRUCT "outer": a at 0, the union at bit 32.
        t.extend([outer, (4 << 24) | 2, 8]);
        t.extend([a, 1, 0]);
        t.extend([0, 3, 32]);
        // [5] FUNC_PROTO (no params), [6] FUNC "f".
        t.extend([0, 13 << 24, 1]);
        t.extend([f, 12 << 24, 5]);
        let types: Vec<u8> = t.iter().flat_map(|w| w.to_ne_bytes()).collect();
        let mut b = Vec::new();
        b.extend(MAGIC.to_ne_bytes());
        b.extend([1u8, 0]);
        for w in [
            24u32,
            0,
            types.len() as u32,
            types.len() as u32,
            strings.len() as u32,
        ] {
            b.extend(w.to_ne_bytes());
        }
        b.extend(types);
        b.extend(strings);
        b
    }

    #[test]
    fn finds_members_through_anonymous_unions_and_functions() {
        let btf = Btf::parse(sample()).unwrap();
        assert_eq!(
            btf.member_bits("outer", "a"),
            Some(MemberBits {
                bit_offset: 0,
                bits: 0
            })
        );
        assert_eq!(
            btf.member_bits("outer", "y"),
            Some(MemberBits {
                bit_offset: 35,
                bits: 2
            })
        );
        assert_eq!(btf.member_bits("outer", "z"), None);
        assert_eq!(btf.member_bits("inner", "x"), None);
        assert_eq!(btf.func_id("f"), Some(6));
        assert_eq!(btf.func_id("int"), None);
    }

    #[test]
    fn malformed_btf_is_an_error() {
        assert!(matches!(
            Btf::parse(b"nope".to_vec()),
            Err(BtfError::Malformed(_))
        ));
        let mut b = sample();
        b.truncate(b.len() - 30);
        assert!(Btf::parse(b).is_err());
    }

    /// The running kernel's BTF: `sk_buff.ip_summed` is a 2-bit field inside one byte and the
    /// kfunc exists (kernel ≥ 6.3). Skipped where the kernel has no BTF.
    #[test]
    fn the_kernel_has_what_the_object_needs() {
        let Ok(btf) = Btf::read(Path::new(VMLINUX)) else {
            eprintln!("skipped: no readable {VMLINUX}");
            return;
        };
        let bits = btf
            .member_bits("sk_buff", "ip_summed")
            .expect("sk_buff.ip_summed");
        assert_eq!(bits.bits, 2);
        assert!(bits.bit_offset % 8 + bits.bits <= 8, "{bits:?}");
        assert!(btf.func_id("bpf_cast_to_kern_ctx").is_some());
    }
}
