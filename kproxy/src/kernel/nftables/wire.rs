//! The pure half of the nf_tables netlink reader: request bytes and the parsing of the
//! kernel's `NEWTABLE` / `NEWCHAIN` / `NEWSET` / `NEWSETELEM` / `NEWRULE` answers
//! (`include/uapi/linux/netfilter/nf_tables.h`). nf_tables integers are big-endian.
//!
//! Set elements are turned into the text `nft` reads and writes (`172.30.0.41 . tcp . 80`,
//! `goto service-…`, `drop`), decoding the key with the set's key type: `nft` stores a
//! concatenation's type as its members' datatype ids, 6 bits each, most significant first,
//! and lays each member in a 4-byte aligned slot of the key.

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::kernel::netlink::{MsgBuilder, NLM_F_DUMP, NLM_F_REQUEST, attrs, read_str};

/// `NFNL_SUBSYS_NFTABLES` (`nfnetlink.h`).
pub(crate) const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub(crate) const NFT_MSG_GETTABLE: u16 = 1;
pub(crate) const NFT_MSG_GETCHAIN: u16 = 4;
pub(crate) const NFT_MSG_GETRULE: u16 = 7;
pub(crate) const NFT_MSG_GETSET: u16 = 10;
pub(crate) const NFT_MSG_GETSETELEM: u16 = 13;

const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_USE: u16 = 3;
const NFTA_TABLE_HANDLE: u16 = 4;

const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_HANDLE: u16 = 2;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;

const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;

const NFTA_SET_TABLE: u16 = 1;
const NFTA_SET_NAME: u16 = 2;
const NFTA_SET_FLAGS: u16 = 3;
const NFTA_SET_KEY_TYPE: u16 = 4;
const NFTA_SET_KEY_LEN: u16 = 5;
const NFTA_SET_DATA_TYPE: u16 = 6;

const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_SET_ELEM_FLAGS: u16 = 3;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;

pub(crate) const NFT_SET_ANONYMOUS: u32 = 0x1;
pub(crate) const NFT_SET_INTERVAL: u32 = 0x4;
pub(crate) const NFT_SET_MAP: u32 = 0x8;
const NFT_SET_ELEM_CATCHALL: u32 = 0x2;
/// `NFT_DATA_VERDICT`: a verdict map's data type.
#[cfg(test)]
pub const NFT_DATA_VERDICT: u32 = 0xffff_ff00;

/// `nft`'s datatype ids (nftables `include/datatype.h`) that kproxy's tables use.
const TYPE_IPADDR: u32 = 7;
const TYPE_IP6ADDR: u32 = 8;
const TYPE_INET_PROTOCOL: u32 = 12;
const TYPE_INET_SERVICE: u32 = 13;
const TYPE_BITS: u32 = 6;

/// A message's answer could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {reason}")]
pub struct WireError {
    pub what: String,
    pub reason: String,
}

fn err(what: &str, reason: impl Into<String>) -> WireError {
    WireError {
        what: what.into(),
        reason: reason.into(),
    }
}

/// The netlink message type of nf_tables message `msg`.
pub(crate) const fn msg_type(msg: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | msg
}

/// `nfgenmsg` of `family` (`NFPROTO_IPV4` = 2, `NFPROTO_IPV6` = 10).
fn nfgen(family: u8) -> [u8; 4] {
    [family, 0, 0, 0]
}

fn be32(p: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(p.get(..4)?.try_into().ok()?))
}

fn be64(p: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(p.get(..8)?.try_into().ok()?))
}

/// The attributes of an answer's payload (after its `nfgenmsg`).
fn body<'a>(payload: &'a [u8], what: &str) -> Result<Vec<(u16, &'a [u8])>, WireError> {
    let rest = payload
        .get(4..)
        .ok_or_else(|| err(what, "answer shorter than its nfgenmsg"))?;
    attrs(rest)
        .collect::<Result<_, _>>()
        .map_err(|e| err(what, e.0))
}

fn nested<'a>(p: &'a [u8], what: &str) -> Result<Vec<(u16, &'a [u8])>, WireError> {
    attrs(p)
        .collect::<Result<_, _>>()
        .map_err(|e| err(what, e.0))
}

fn get<'a>(a: &[(u16, &'a [u8])], kind: u16) -> Option<&'a [u8]> {
    a.iter().find(|(k, _)| *k == kind).map(|(_, p)| *p)
}

/// `GETTABLE` of one table (not a dump).
pub(crate) fn get_table(family: u8, table: &str) -> MsgBuilder {
    let mut m = MsgBuilder::new(msg_type(NFT_MSG_GETTABLE), NLM_F_REQUEST).header(&nfgen(family));
    m.str(NFTA_TABLE_NAME, table);
    m
}

/// A dump of `msg` (`GETCHAIN`, `GETSET`, `GETRULE`) restricted to `table` (and `chain` for
/// rules); the kernel filters set and rule dumps, chains are filtered here.
pub(crate) fn dump(family: u8, msg: u16, table: &str, chain: Option<&str>) -> MsgBuilder {
    let mut m = MsgBuilder::new(msg_type(msg), NLM_F_REQUEST | NLM_F_DUMP).header(&nfgen(family));
    // NFTA_CHAIN_TABLE, NFTA_SET_TABLE and NFTA_RULE_TABLE are all 1.
    m.str(NFTA_RULE_TABLE, table);
    if let Some(c) = chain {
        m.str(NFTA_RULE_CHAIN, c);
    }
    m
}

/// A dump of `set`'s elements.
pub(crate) fn dump_elements(family: u8, table: &str, set: &str) -> MsgBuilder {
    let mut m = MsgBuilder::new(msg_type(NFT_MSG_GETSETELEM), NLM_F_REQUEST | NLM_F_DUMP)
        .header(&nfgen(family));
    m.str(NFTA_SET_ELEM_LIST_TABLE, table);
    m.str(NFTA_SET_ELEM_LIST_SET, set);
    m
}

/// A table as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableInfo {
    pub name: String,
    /// Changes when the table is deleted and created again.
    pub handle: u64,
    /// How many chains the table holds.
    pub chains: u32,
}

pub(crate) fn parse_table(payload: &[u8]) -> Result<TableInfo, WireError> {
    let a = body(payload, "table")?;
    let name = get(&a, NFTA_TABLE_NAME)
        .map(read_str)
        .ok_or_else(|| err("table", "no name"))?;
    Ok(TableInfo {
        handle: get(&a, NFTA_TABLE_HANDLE).and_then(be64).unwrap_or(0),
        chains: get(&a, NFTA_TABLE_USE).and_then(be32).unwrap_or(0),
        name,
    })
}

/// A chain: its table, name, handle and whether it is a base chain (has a hook).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainInfo {
    pub table: String,
    pub name: String,
    pub handle: u64,
    pub base: bool,
}

pub(crate) fn parse_chain(payload: &[u8]) -> Result<ChainInfo, WireError> {
    let a = body(payload, "chain")?;
    let name = get(&a, NFTA_CHAIN_NAME)
        .map(read_str)
        .ok_or_else(|| err("chain", "no name"))?;
    Ok(ChainInfo {
        table: get(&a, NFTA_CHAIN_TABLE).map(read_str).unwrap_or_default(),
        handle: get(&a, NFTA_CHAIN_HANDLE).and_then(be64).unwrap_or(0),
        base: get(&a, NFTA_CHAIN_HOOK).is_some(),
        name,
    })
}

/// The chain a rule belongs to (rule dumps are only counted).
pub(crate) fn parse_rule_chain(payload: &[u8]) -> Result<String, WireError> {
    let a = body(payload, "rule")?;
    get(&a, NFTA_RULE_CHAIN)
        .map(read_str)
        .ok_or_else(|| err("rule", "no chain"))
}

/// A set or map: what decoding its elements needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetInfo {
    pub table: String,
    pub name: String,
    pub flags: u32,
    pub key_type: u32,
    pub key_len: u32,
    /// `Some` for maps ([`NFT_DATA_VERDICT`] for verdict maps).
    pub data_type: Option<u32>,
}

impl SetInfo {
    pub(crate) fn is_map(&self) -> bool {
        self.flags & NFT_SET_MAP != 0
    }
    pub(crate) fn is_anonymous(&self) -> bool {
        self.flags & NFT_SET_ANONYMOUS != 0
    }
}

pub(crate) fn parse_set(payload: &[u8]) -> Result<SetInfo, WireError> {
    let a = body(payload, "set")?;
    let name = get(&a, NFTA_SET_NAME)
        .map(read_str)
        .ok_or_else(|| err("set", "no name"))?;
    let what = format!("set {name}");
    let num = |kind: u16, field: &str| {
        get(&a, kind)
            .and_then(be32)
            .ok_or_else(|| err(&what, format!("no {field}")))
    };
    Ok(SetInfo {
        table: get(&a, NFTA_SET_TABLE).map(read_str).unwrap_or_default(),
        flags: get(&a, NFTA_SET_FLAGS).and_then(be32).unwrap_or(0),
        key_type: num(NFTA_SET_KEY_TYPE, "key type")?,
        key_len: num(NFTA_SET_KEY_LEN, "key length")?,
        data_type: get(&a, NFTA_SET_DATA_TYPE).and_then(be32),
        name,
    })
}

/// The members of a (possibly concatenated) key type, first member first.
fn key_members(key_type: u32) -> Vec<u32> {
    let mut out = vec![];
    let mut t = key_type;
    while t != 0 {
        out.push(t & ((1 << TYPE_BITS) - 1));
        t >>= TYPE_BITS;
    }
    out.reverse();
    out
}

fn member_len(t: u32) -> Option<usize> {
    Some(match t {
        TYPE_IPADDR => 4,
        TYPE_IP6ADDR => 16,
        TYPE_INET_PROTOCOL => 1,
        TYPE_INET_SERVICE => 2,
        _ => return None,
    })
}

fn protocol_name(p: u8) -> String {
    match p {
        6 => "tcp".into(),
        17 => "udp".into(),
        132 => "sctp".into(),
        n => n.to_string(),
    }
}

fn member_text(t: u32, b: &[u8]) -> String {
    match t {
        TYPE_IPADDR => Ipv4Addr::from(<[u8; 4]>::try_from(b).expect("4 bytes")).to_string(),
        TYPE_IP6ADDR => Ipv6Addr::from(<[u8; 16]>::try_from(b).expect("16 bytes")).to_string(),
        TYPE_INET_PROTOCOL => protocol_name(b[0]),
        _ => u16::from_be_bytes([b[0], b[1]]).to_string(),
    }
}

/// A key in `nft`'s text form (`a . b . c` for a concatenation) decoded with `set`'s type.
pub(crate) fn key_text(set: &SetInfo, key: &[u8]) -> Result<String, WireError> {
    let what = format!("set {}", set.name);
    let members = key_members(set.key_type);
    let concat = members.len() > 1;
    let mut at = 0;
    let mut parts = vec![];
    for t in &members {
        let len = member_len(*t).ok_or_else(|| {
            err(
                &what,
                format!("key type {:#x}: unknown member {t}", set.key_type),
            )
        })?;
        let b = key
            .get(at..at + len)
            .ok_or_else(|| err(&what, format!("key of {} bytes is too short", key.len())))?;
        parts.push(member_text(*t, b));
        at += if concat { len.div_ceil(4) * 4 } else { len };
    }
    if members.is_empty() || at != key.len() {
        return Err(err(
            &what,
            format!(
                "key of {} bytes does not fit key type {:#x}",
                key.len(),
                set.key_type
            ),
        ));
    }
    Ok(parts.join(" . "))
}

/// A verdict (`NFTA_DATA_VERDICT`'s content) as `nft` writes it.
pub(crate) fn verdict_text(p: &[u8], what: &str) -> Result<String, WireError> {
    let a = nested(p, what)?;
    let code = get(&a, NFTA_VERDICT_CODE)
        .and_then(be32)
        .ok_or_else(|| err(what, "verdict without a code"))? as i32;
    let chain = get(&a, NFTA_VERDICT_CHAIN).map(read_str);
    let with_chain = |verb: &str| match &chain {
        Some(c) => Ok(format!("{verb} {c}")),
        None => Err(err(what, format!("{verb} without a chain"))),
    };
    match code {
        0 => Ok("drop".into()),
        1 => Ok("accept".into()),
        -1 => Ok("continue".into()),
        -3 => with_chain("jump"),
        -4 => with_chain("goto"),
        -5 => Ok("return".into()),
        c => Err(err(what, format!("unknown verdict code {c}"))),
    }
}

/// The elements of one `NEWSETELEM` answer as (key, value) texts; a catch-all element has
/// the key `*`. Interval sets are refused (kproxy creates none; their elements come as
/// start/end pairs).
pub(crate) fn parse_elements(
    set: &SetInfo,
    payload: &[u8],
) -> Result<Vec<(String, Option<String>)>, WireError> {
    let what = format!("elements of {}", set.name);
    if set.flags & NFT_SET_INTERVAL != 0 {
        return Err(err(&what, "interval sets are not supported"));
    }
    let a = body(payload, &what)?;
    let Some(list) = get(&a, NFTA_SET_ELEM_LIST_ELEMENTS) else {
        return Ok(vec![]);
    };
    let mut out = vec![];
    for (kind, elem) in nested(list, &what)? {
        if kind != NFTA_LIST_ELEM {
            continue;
        }
        let e = nested(elem, &what)?;
        let flags = get(&e, NFTA_SET_ELEM_FLAGS).and_then(be32).unwrap_or(0);
        let key = if flags & NFT_SET_ELEM_CATCHALL != 0 {
            "*".to_string()
        } else {
            let k =
                get(&e, NFTA_SET_ELEM_KEY).ok_or_else(|| err(&what, "element without a key"))?;
            let v = get(&nested(k, &what)?, NFTA_DATA_VALUE)
                .ok_or_else(|| err(&what, "key without a value"))?;
            key_text(set, v)?
        };
        let value = match get(&e, NFTA_SET_ELEM_DATA) {
            None => None,
            Some(d) => {
                let d = nested(d, &what)?;
                match (get(&d, NFTA_DATA_VERDICT), get(&d, NFTA_DATA_VALUE)) {
                    (Some(v), _) => Some(verdict_text(v, &format!("{what}: {key}"))?),
                    (None, Some(v)) => Some(format!("0x{}", hex(v))),
                    (None, None) => return Err(err(&what, format!("{key}: data without a value"))),
                }
            }
        };
        out.push((key, value));
    }
    Ok(out)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::netlink::unhex;

    // Answers captured from Linux 6.18 (nft 1.0.6) for this table:
    //   set cluster-ips { type ipv4_addr; comment "Active ClusterIPs"; }
    //   map service-ips { type ipv4_addr . inet_proto . inet_service : verdict; }
    //   chain services {}
    //   chain nat-prerouting { type nat hook prerouting priority -100; jump services; }
    //   chain service-X/ns/s/tcp/p { numgen random mod 2 vmap { 0 : goto services, 1 : goto services } }
    // with cluster-ips { 172.30.0.41 } and service-ips { 172.30.0.41 . tcp . 80 : goto
    // service-X/ns/s/tcp/p, 172.30.0.42 . udp . 53 : drop }.
    const TABLE: &str = "020000020f0001006b7562652d70726f7879000008000300000000050c00040000000000000000010800020000000000";
    const CHAIN_SERVICES: &str = "020000020f0001006b7562652d70726f787900000d0003007365727669636573000000000c00020000000000000000010800060000000003";
    const CHAIN_NAT_PREROUTING: &str = "020000020f0001006b7562652d70726f78790000130003006e61742d707265726f7574696e6700000c000200000000000000000214000400080001000000000008000200ffffff9c0800050000000001080007006e61740008000a00000000010800060000000001";
    const SET_CLUSTER_IPS: &str = "020000020f0001006b7562652d70726f7879000010000200636c75737465722d697073000c0010000000000000000004080004000000000708000500000000041e000d00000402000000071241637469766520436c7573746572495073000000040009001700130030786666666666666666383235303766343000000800140000000001";
    const MAP_SERVICE_IPS: &str = "020000020f0001006b7562652d70726f7879000010000200736572766963652d697073000c00100000000000000000050800030000000008080004000000730d080005000000000c08000600ffffff00080007000000001020000d00000400000000010400000000030800040d0000000100060400000000040009001700130030786666666666666666383235303766343000000800140000000002";
    const ANON_MAP: &str = "020000020f0001006b7562652d70726f787900000b0002005f5f6d61703000000c0010000000000000000007080003000000000b0800040000000004080005000000000408000600ffffff00080007000000001020000d00000401000000010400000000040800040100000001000604000000000c00090008000100000000021700130030786666666666666666383235303764633000000800140000000002";
    const ELEMS_SERVICE_IPS: &str = "020000020f0001006b7562652d70726f7879000010000200736572766963652d6970730070000300440001001400010010000100ac1e002906000000005000002c0002002800020008000100fffffffc19000200736572766963652d582f6e732f732f7463702f7000000000280001001400010010000100ac1e002a1100000000350000100002000c0002000800010000000000";
    const ELEMS_CLUSTER_IPS: &str = "020000020f0001006b7562652d70726f7879000010000200636c75737465722d6970730014000300100001000c00010008000100ac1e0029";
    const ELEMS_EMPTY: &str =
        "020000020f0001006b7562652d70726f7879000010000200636c75737465722d6970730004000300";

    #[test]
    fn tables_and_chains_parse_from_captured_answers() {
        assert_eq!(
            parse_table(&unhex(TABLE)).unwrap(),
            TableInfo {
                name: "kube-proxy".into(),
                handle: 1,
                chains: 5,
            }
        );
        let c = parse_chain(&unhex(CHAIN_SERVICES)).unwrap();
        assert_eq!(
            (c.table.as_str(), c.name.as_str(), c.base),
            ("kube-proxy", "services", false)
        );
        let c = parse_chain(&unhex(CHAIN_NAT_PREROUTING)).unwrap();
        assert_eq!(
            (c.name.as_str(), c.handle, c.base),
            ("nat-prerouting", 2, true)
        );
        // Cut inside an attribute: an error naming the object, not a panic.
        let cut = &unhex(CHAIN_SERVICES)[..30];
        assert!(
            parse_chain(cut)
                .unwrap_err()
                .to_string()
                .starts_with("chain:")
        );
    }

    #[test]
    fn sets_maps_and_anonymous_maps() {
        let set = parse_set(&unhex(SET_CLUSTER_IPS)).unwrap();
        assert_eq!(
            (set.name.as_str(), set.key_type, set.key_len),
            ("cluster-ips", TYPE_IPADDR, 4)
        );
        assert!(!set.is_map() && !set.is_anonymous() && set.data_type.is_none());
        let map = parse_set(&unhex(MAP_SERVICE_IPS)).unwrap();
        assert!(map.is_map() && !map.is_anonymous());
        assert_eq!(
            key_members(map.key_type),
            [TYPE_IPADDR, TYPE_INET_PROTOCOL, TYPE_INET_SERVICE]
        );
        assert_eq!((map.key_len, map.data_type), (12, Some(NFT_DATA_VERDICT)));
        let anon = parse_set(&unhex(ANON_MAP)).unwrap();
        assert!(anon.is_anonymous() && anon.name == "__map0");
    }

    #[test]
    fn elements_read_back_as_nft_writes_them() {
        let map = parse_set(&unhex(MAP_SERVICE_IPS)).unwrap();
        assert_eq!(
            parse_elements(&map, &unhex(ELEMS_SERVICE_IPS)).unwrap(),
            vec![
                (
                    "172.30.0.41 . tcp . 80".to_string(),
                    Some("goto service-X/ns/s/tcp/p".to_string())
                ),
                (
                    "172.30.0.42 . udp . 53".to_string(),
                    Some("drop".to_string())
                ),
            ]
        );
        let set = parse_set(&unhex(SET_CLUSTER_IPS)).unwrap();
        assert_eq!(
            parse_elements(&set, &unhex(ELEMS_CLUSTER_IPS)).unwrap(),
            vec![("172.30.0.41".to_string(), None)]
        );
        assert_eq!(parse_elements(&set, &unhex(ELEMS_EMPTY)).unwrap(), vec![]);
        // Decoded with the wrong type: an error naming the set.
        let e = parse_elements(&set, &unhex(ELEMS_SERVICE_IPS)).unwrap_err();
        assert!(e.to_string().contains("cluster-ips"), "{e}");
        let interval = SetInfo {
            flags: NFT_SET_INTERVAL,
            ..set
        };
        assert!(parse_elements(&interval, &unhex(ELEMS_CLUSTER_IPS)).is_err());
    }

    #[test]
    fn keys_of_other_types() {
        let v6 = SetInfo {
            table: "kube-proxy".into(),
            name: "cluster-ips".into(),
            flags: 0,
            key_type: TYPE_IP6ADDR,
            key_len: 16,
            data_type: None,
        };
        assert_eq!(
            key_text(&v6, &unhex("fd000000000000000000000000000001")).unwrap(),
            "fd00::1"
        );
        let l4 = SetInfo {
            key_type: (TYPE_INET_PROTOCOL << TYPE_BITS) | TYPE_INET_SERVICE,
            key_len: 8,
            ..v6.clone()
        };
        assert_eq!(
            key_text(&l4, &unhex("8400000075300000")).unwrap(),
            "sctp . 30000"
        );
        let mark = SetInfo { key_type: 19, ..v6 };
        assert!(
            key_text(&mark, &[0; 4])
                .unwrap_err()
                .to_string()
                .contains("unknown member")
        );
    }

    #[test]
    fn verdicts() {
        // NFTA_VERDICT_CODE NFT_JUMP, NFTA_VERDICT_CHAIN "svc"
        assert_eq!(
            verdict_text(&unhex("08000100fffffffd0800020073766300"), "t").unwrap(),
            "jump svc"
        );
        assert_eq!(
            verdict_text(&unhex("0800010000000001"), "t").unwrap(),
            "accept"
        );
        assert!(verdict_text(&unhex("08000100fffffffc"), "t").is_err());
        assert!(verdict_text(&unhex("0800010000000007"), "t").is_err());
    }

    #[test]
    fn requests_carry_the_table_and_family() {
        let m = dump_elements(NFPROTO_IPV6_TEST, "kube-proxy", "service-ips").finish(7);
        assert_eq!(
            u16::from_ne_bytes([m[4], m[5]]),
            (10 << 8) | NFT_MSG_GETSETELEM
        );
        assert_eq!(m[16], NFPROTO_IPV6_TEST);
        assert!(m.windows(11).any(|w| w == b"service-ips"));
    }
    const NFPROTO_IPV6_TEST: u8 = 10;
}
