//! Heartbeat authentication: signing and checking one heartbeat (HMAC-SHA256),
//! median of ROUNDS rounds of 100,000.
use std::time::Instant;

use anyhow::Result;
use vip_agent::ha::{auth::Keys, heartbeat::Heartbeat};
use vip_tests::halab;

use crate::{
    measure::median,
    report::{at, line, Section, Table},
};

const ROUNDS: usize = 7;

pub fn section() -> Result<Section> {
    let keys = Keys::new(&[halab::random_key().into_bytes()])?;
    let hb = Heartbeat {
        v: Heartbeat::VERSION,
        node: "node-123".into(),
        incarnation: 1_795_391_020_187_672_419,
        seq: 123_456,
        sent_ms: 1_795_391_020_187,
        leaving_ms: 0,
        arp: Vec::new(),
        settings: String::new(),
    }
    .encode();
    let n = 100_000u32;
    let (mut seal, mut open) = (Vec::new(), Vec::new());
    let sealed = keys.seal(&hb);
    for _ in 0..ROUNDS {
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(keys.seal(std::hint::black_box(&hb)));
        }
        seal.push(t.elapsed().as_nanos() as f64 / f64::from(n));
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(keys.open(std::hint::black_box(&sealed)).is_ok());
        }
        open.push(t.elapsed().as_nanos() as f64 / f64::from(n));
    }
    let a = at("heartbeat_auth_ns");
    let mut s =
        Section::new(line!("Heartbeat authentication (HMAC-SHA256, {} bytes signed; median of {ROUNDS} rounds of {n})", a.f("bytes").show(sealed.len())));
    let mut t = Table::new("| operation | ns per heartbeat |", "|---|---:|");
    t.row(line!("| sign (sender, once per interval for all peers) | {} |", a.f("seal").num(median(seal), 0)));
    t.row(line!("| check (receiver) | {} |", a.f("open").num(median(open), 0)));
    s.table(t);
    Ok(s)
}
