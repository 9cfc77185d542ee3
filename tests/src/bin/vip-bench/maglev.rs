//! Maglev ring build cost and quality (userspace).
use std::time::Instant;

use anyhow::Result;
use vip_agent::maglev::{self, Member};

use crate::{
    measure::median,
    report::{at, line, Section, Table},
};

pub fn section() -> Result<Section> {
    let mut s = Section::new(line!("Maglev ring build (userspace, median of 15 builds)"));
    let mut t = Table::new("| M (table) | N (backends) | build time | largest/smallest share |", "|---:|---:|---:|---:|");
    for (m, n) in [(65537u32, 10usize), (65537, 100), (65537, 1000), (16381, 100)] {
        let members: Vec<Member> = (0..n).map(|i| Member::new(format!("node-{i:05}"))).collect();
        let mut times = Vec::new();
        let mut ring = None;
        for _ in 0..15 {
            let t = Instant::now();
            ring = Some(maglev::build(&members, m, 0)?);
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let shares = ring.unwrap().shares();
        let spread = f64::from(*shares.iter().max().unwrap()) / f64::from(*shares.iter().min().unwrap());
        let a = at(format!("maglev_build_m{m}_n{n}"));
        t.row(line!("| {m} | {n} | {} ms | {} |", a.f("ms").num(median(times), 3), a.f("max_min_share").num(spread, 4)));
    }
    s.table(t);
    let members: Vec<Member> = (0..100).map(|i| Member::new(format!("node-{i:05}"))).collect();
    let before = maglev::build(&members, 65537, 0)?;
    let after = maglev::build(&members[1..], 65537, 0)?;
    let changed = (0..65537).filter(|&i| before.member_at(i) != after.member_at(i)).count();
    let owned = f64::from(before.shares()[0]) * 100.0 / 65537.0;
    s.para(line!(
        "One of N=100 backends removed at M=65537: {changed} slots changed ({}%; the removed backend owned {owned:.2}%). Target ≤ 2%.",
        at("maglev_removal_changed_pct").num(changed as f64 * 100.0 / 65537.0, 2)
    ));
    Ok(s)
}
