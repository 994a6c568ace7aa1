//! A packet tracer over an nftables table (kproxy's in-memory [`FakeTable`]), with the
//! semantics of upstream kube-proxy's nft test tracer (`tracePacket` in
//! pkg/proxy/nftables/helpers_test.go; see `tests/fixtures/upstream/nftables/README.md`):
//!
//! runs `filter-prerouting-pre-dnat` (stop if it drops or rejects), then `nat-prerouting`;
//! the destination becomes the first DNAT target's IP; then `filter-forward` (stop if it
//! drops or rejects) and `filter-input`. Matches understood: `ip/ip6 saddr|daddr [!=]` with a
//! literal, CIDR, anonymous set `{ … }` or `@set`; concatenated `… vmap @map` lookups;
//! `meta l4proto P`; `th|tcp|udp|sctp dport N`; `fib saddr|daddr type local` (the case's
//! local IPs); `ct state new` (always true). Verdicts: `jump`/`goto`/`return`, `drop` →
//! `DROP`, `reject` → `REJECT`, `dnat to` → an output; `jump mark-for-masquerade` sets the
//! masquerade flag; a `numgen … vmap { … }` follows every branch (so every endpoint is seen).
//! Anything else is an error naming the rule, so the tracer never silently guesses.

use std::net::IpAddr;

use ipnet::IpNet;
use kproxy::dataplane::nftables::FakeTable;

/// Outcome of tracing one packet.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    /// `DROP`, `REJECT`, the DNAT targets joined by `, `, or empty (accepted untouched).
    pub output: String,
    pub masq: bool,
    /// Every rule that matched, as `chain: rule`.
    pub matches: Vec<String>,
}

/// The packet being traced.
#[derive(Debug, Clone)]
pub struct Packet {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: String,
    pub dport: u16,
}

enum Flow {
    Continue,
    Return,
    Stop(&'static str),
}

struct Tracer<'a> {
    table: &'a FakeTable,
    local: &'a [IpAddr],
    pkt: Packet,
    masq: bool,
    outputs: Vec<String>,
    matches: Vec<String>,
    depth: usize,
}

fn ip_matches(value: &str, ip: &IpAddr) -> Result<bool, String> {
    if let Ok(a) = value.parse::<IpAddr>() {
        return Ok(a == *ip);
    }
    if let Ok(n) = value.parse::<IpNet>() {
        return Ok(n.contains(ip));
    }
    Err(format!("not an IP or CIDR: {value:?}"))
}

/// Whether the key of a map/set element (` . `-separated) equals `want`.
fn key_equals(key: &str, want: &[String]) -> bool {
    let parts: Vec<&str> = key.split(" . ").map(str::trim).collect();
    parts.len() == want.len()
        && parts
            .iter()
            .zip(want)
            .all(|(p, w)| match (p.parse::<IpAddr>(), w.parse::<IpAddr>()) {
                (Ok(a), Ok(b)) => a == b,
                _ => p == w,
            })
}

impl Tracer<'_> {
    fn set_contains(&self, name: &str, ip: &IpAddr) -> Result<bool, String> {
        let set = self
            .table
            .sets
            .get(name)
            .ok_or_else(|| format!("no set {name}"))?;
        for k in set.elements.keys() {
            if ip_matches(k, ip)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn field(&self, sel: &str) -> Result<String, String> {
        Ok(match sel {
            "saddr" => self.pkt.src.to_string(),
            "daddr" => self.pkt.dst.to_string(),
            "l4proto" => self.pkt.proto.clone(),
            "dport" => self.pkt.dport.to_string(),
            other => return Err(format!("unknown selector {other}")),
        })
    }

    /// Parses a `sel . sel …` key starting at `w[i]`; returns the values and the next index.
    fn key(&self, w: &[&str], mut i: usize) -> Result<(Vec<String>, usize), String> {
        let mut vals = vec![];
        loop {
            let sel = w.get(i + 1).ok_or("truncated key")?;
            vals.push(self.field(sel)?);
            i += 2;
            if w.get(i) == Some(&".") {
                i += 1;
            } else {
                return Ok((vals, i));
            }
        }
    }

    /// Runs `chain`; `Return`/`Continue` mean the packet fell off its end.
    fn run(&mut self, chain: &str) -> Result<Flow, String> {
        self.depth += 1;
        if self.depth > 64 {
            return Err(format!("jump loop at {chain}"));
        }
        if chain == "mark-for-masquerade" {
            self.masq = true;
        }
        let rules = self
            .table
            .chains
            .get(chain)
            .ok_or_else(|| format!("no chain {chain}"))?
            .rules
            .clone();
        let mut result = Flow::Continue;
        for (rule, _) in &rules {
            match self.rule(chain, rule)? {
                Flow::Continue => {}
                Flow::Return => break,
                stop @ Flow::Stop(_) => {
                    result = stop;
                    break;
                }
            }
        }
        self.depth -= 1;
        Ok(result)
    }

    fn verdict(&mut self, v: &str) -> Result<Flow, String> {
        let w: Vec<&str> = v.split_whitespace().collect();
        match w.as_slice() {
            ["drop"] => Ok(Flow::Stop("DROP")),
            ["reject"] => Ok(Flow::Stop("REJECT")),
            ["return"] => Ok(Flow::Return),
            ["accept"] => Ok(Flow::Stop("ACCEPT")),
            ["jump", c] => match self.run(c)? {
                stop @ Flow::Stop(_) => Ok(stop),
                _ => Ok(Flow::Continue),
            },
            ["goto", c] => match self.run(c)? {
                stop @ Flow::Stop(_) => Ok(stop),
                _ => Ok(Flow::Return),
            },
            _ => Err(format!("unknown verdict {v:?}")),
        }
    }

    /// Evaluates one rule: `Continue` when it does not match (or matched without verdict).
    fn rule(&mut self, chain: &str, rule: &str) -> Result<Flow, String> {
        let w: Vec<&str> = rule.split_whitespace().collect();
        let mut i = 0;
        while i < w.len() {
            match w[i] {
                "ct" if w.get(1 + i..3 + i) == Some(&["state", "new"][..]) => i += 3,
                "ip" | "ip6" | "meta" | "th" if w.get(i + 2) == Some(&".") => {
                    let (key, next) = self.key(&w, i)?;
                    if w.get(next) != Some(&"vmap") {
                        return Err(format!("concatenation without vmap: {rule}"));
                    }
                    let map = w
                        .get(next + 1)
                        .and_then(|m| m.strip_prefix('@'))
                        .ok_or("vmap without @map")?;
                    let set = self
                        .table
                        .sets
                        .get(map)
                        .ok_or_else(|| format!("no map {map}"))?;
                    let hit = set
                        .elements
                        .iter()
                        .find(|(k, _)| key_equals(k, &key))
                        .and_then(|(_, (v, _))| v.clone());
                    let Some(v) = hit else {
                        return Ok(Flow::Continue);
                    };
                    self.matches.push(format!("{chain}: {rule} [{v}]"));
                    return self.verdict(&v);
                }
                "ip" | "ip6" => {
                    let sel = w.get(i + 1).ok_or("truncated rule")?;
                    let ip: IpAddr = self.field(sel)?.parse().map_err(|_| "bad ip")?;
                    let mut j = i + 2;
                    let neg = w.get(j) == Some(&"!=");
                    if neg {
                        j += 1;
                    }
                    let value = *w.get(j).ok_or("truncated rule")?;
                    let (hit, next) = if value == "{" {
                        let end = w[j..].iter().position(|t| *t == "}").ok_or("unclosed {")? + j;
                        let mut hit = false;
                        for item in w[j + 1..end].join(" ").split(',') {
                            let item = item.trim();
                            if !item.is_empty() && ip_matches(item, &ip)? {
                                hit = true;
                            }
                        }
                        (hit, end + 1)
                    } else if let Some(set) = value.strip_prefix('@') {
                        (self.set_contains(set, &ip)?, j + 1)
                    } else {
                        (ip_matches(value, &ip)?, j + 1)
                    };
                    if hit == neg {
                        return Ok(Flow::Continue);
                    }
                    i = next;
                }
                "meta" if w.get(i + 1) == Some(&"l4proto") => {
                    if w.get(i + 2).copied() != Some(self.pkt.proto.as_str()) {
                        return Ok(Flow::Continue);
                    }
                    i += 3;
                }
                "th" | "tcp" | "udp" | "sctp" if w.get(i + 1) == Some(&"dport") => {
                    if w[i] != "th" && w[i] != self.pkt.proto {
                        return Ok(Flow::Continue);
                    }
                    if w.get(i + 2).and_then(|p| p.parse::<u16>().ok()) != Some(self.pkt.dport) {
                        return Ok(Flow::Continue);
                    }
                    i += 3;
                }
                "fib" if w.get(i + 2..i + 4) == Some(&["type", "local"][..]) => {
                    let ip: IpAddr = self.field(w[i + 1])?.parse().map_err(|_| "bad ip")?;
                    if !self.local.contains(&ip) {
                        return Ok(Flow::Continue);
                    }
                    i += 4;
                }
                "numgen" => return self.numgen(chain, rule, &w[i..]),
                "dnat" if w.get(i + 1) == Some(&"to") => {
                    let target = w.get(i + 2).ok_or("dnat without target")?;
                    self.matches.push(format!("{chain}: {rule}"));
                    self.outputs.push(target.to_string());
                    return Ok(Flow::Stop("DNAT"));
                }
                "update" => {
                    let end = w[i..].iter().position(|t| *t == "}").ok_or("unclosed {")? + i;
                    i = end + 1;
                }
                "mark" | "masquerade" => return Ok(Flow::Continue),
                "jump" | "goto" | "drop" | "reject" | "return" | "accept" => {
                    self.matches.push(format!("{chain}: {rule}"));
                    return self.verdict(&w[i..].join(" "));
                }
                other => return Err(format!("unknown match {other:?} in {chain}: {rule}")),
            }
        }
        Ok(Flow::Continue)
    }

    /// `numgen random mod N vmap { 0 : goto A , 1 : goto B }`: every branch is followed.
    fn numgen(&mut self, chain: &str, rule: &str, w: &[&str]) -> Result<Flow, String> {
        self.matches.push(format!("{chain}: {rule}"));
        let open = w
            .iter()
            .position(|t| *t == "{")
            .ok_or("numgen without map")?;
        let close = w.iter().position(|t| *t == "}").ok_or("unclosed {")?;
        let body = w[open + 1..close].join(" ");
        let mut last = Flow::Return;
        for branch in body.split(" , ") {
            let (_, verdict) = branch.split_once(" : ").ok_or("bad numgen branch")?;
            last = match self.verdict(verdict.trim())? {
                Flow::Stop("DNAT") => Flow::Stop("DNAT"),
                stop @ Flow::Stop(_) => return Ok(stop),
                _ => Flow::Return,
            };
        }
        Ok(last)
    }
}

fn dnat_ip(target: &str) -> Option<IpAddr> {
    let host = match target.strip_prefix('[') {
        Some(rest) => rest.split(']').next()?,
        None => target.rsplit_once(':').map_or(target, |(h, _)| h),
    };
    host.parse().ok()
}

/// Traces `pkt` through `table` (see the module docs).
pub fn trace_packet(table: &FakeTable, local_ips: &[IpAddr], pkt: Packet) -> Result<Trace, String> {
    let mut t = Tracer {
        table,
        local: local_ips,
        pkt,
        masq: false,
        outputs: vec![],
        matches: vec![],
        depth: 0,
    };
    let done = |t: Tracer<'_>, out: &str| Trace {
        output: out.to_string(),
        masq: t.masq,
        matches: t.matches,
    };
    if let Flow::Stop(v @ ("DROP" | "REJECT")) = t.run("filter-prerouting-pre-dnat")? {
        return Ok(done(t, v));
    }
    t.run("nat-prerouting")?;
    if let Some(ip) = t.outputs.first().and_then(|o| dnat_ip(o)) {
        t.pkt.dst = ip;
    }
    for chain in ["filter-forward", "filter-input"] {
        if let Flow::Stop(v @ ("DROP" | "REJECT")) = t.run(chain)? {
            return Ok(done(t, v));
        }
    }
    // Like upstream's nft tracer: no DNAT and no drop/reject is an empty output.
    let out = t.outputs.join(", ");
    Ok(done(t, &out))
}
