//! A minimal HTTP/1.1 client for tests of kproxy's servers (healthz, metrics,
//! healthCheckNodePort): one `GET` per connection, the whole response read.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Header names lower-cased.
    pub headers: BTreeMap<String, String>,
    pub body: String,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }
}

/// `GET path` from `addr` (`Connection: close`).
pub async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<Response> {
    request(addr, path, "").await
}

/// `GET path` from `addr` with `Accept: accept`.
pub async fn get_accepting(addr: SocketAddr, path: &str, accept: &str) -> anyhow::Result<Response> {
    request(addr, path, &format!("Accept: {accept}\r\n")).await
}

async fn request(addr: SocketAddr, path: &str, headers: &str) -> anyhow::Result<Response> {
    let mut s = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .with_context(|| format!("connecting to {addr} timed out"))??;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Connection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut raw))
        .await
        .with_context(|| format!("reading from {addr} timed out"))??;
    parse(&raw)
}

fn parse(raw: &[u8]) -> anyhow::Result<Response> {
    let text = String::from_utf8_lossy(raw);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        bail!("no end of headers in {text:?}");
    };
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad status line {status_line:?}"))?;
    let headers: BTreeMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let body = if headers
        .get("transfer-encoding")
        .is_some_and(|t| t.eq_ignore_ascii_case("chunked"))
    {
        dechunk(body)?
    } else {
        body.to_owned()
    };
    Ok(Response {
        status,
        headers,
        body,
    })
}

fn dechunk(mut s: &str) -> anyhow::Result<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n").context("bad chunk header")?;
        let n = usize::from_str_radix(size.trim(), 16).context("bad chunk size")?;
        if n == 0 {
            return Ok(out);
        }
        out.push_str(rest.get(..n).context("short chunk")?);
        s = rest.get(n + 2..).unwrap_or("");
    }
}

/// Polls `GET path` until `pred` holds for a response or `timeout` passes; returns the
/// matching response (connection errors count as not matching).
pub async fn wait_for(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
    what: &str,
    pred: impl Fn(&Response) -> bool,
) -> Response {
    let deadline = Instant::now() + timeout;
    let mut last;
    loop {
        match get(addr, path).await {
            Ok(r) if pred(&r) => return r,
            Ok(r) => last = format!("{} {:?}", r.status, r.body),
            Err(e) => last = format!("{e:#}"),
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what} on {addr}{path}; last: {last}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls until connecting to `addr` is refused (the server closed), or panics after `timeout`.
pub async fn wait_closed(addr: SocketAddr, timeout: Duration, what: &str) {
    let deadline = Instant::now() + timeout;
    loop {
        if TcpStream::connect(addr).await.is_err() {
            return;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}: {addr} still accepts");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of one sample line `name{labels} value` in a Prometheus/OpenMetrics text
/// exposition (`series` is everything before the value, e.g. `foo_total{code="200"}`).
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        let rest = rest.strip_prefix(' ')?;
        rest.split(' ').next()?.parse().ok()
    })
}
