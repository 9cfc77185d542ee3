//! Health change → maps updated, with the real agent in the single-load-balancer
//! lab: a backend's server is stopped and restarted TRIALS times; the agent
//! stamps each decided change and reports the time until every affected ring was
//! written (status `health_to_maps_us`). The bench also times, by polling the
//! status every 5 ms, the fault → out-of-ring interval the health check bounds.
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use vip_tests::agent::{lb_config, wait_for, Check, LbLab};

use crate::{
    measure::Dist,
    report::{at, line, Section, Table},
};

const TRIALS: usize = 20;

pub fn section() -> Result<Section> {
    let check = Check { interval_ms: 100, timeout_ms: 50, rise: 2, fall: 3 };
    let mut lab = LbLab::start(3, &lb_config(3, "80", check, ""), 9473)?;
    lab.wait_ready(Duration::from_secs(10))?;
    let state = |lab: &LbLab, want: (bool, bool)| wait_for(Duration::from_secs(5), || (lab.backend_state("b2")? == want).then_some(()));
    let mut detect = Vec::new();
    for _ in 0..TRIALS {
        let t = Instant::now();
        lab.backends[1].halt();
        state(&lab, (false, false)).context("b2 never left the ring")?;
        detect.push(t.elapsed().as_secs_f64() * 1e3);
        lab.backends[1].serve()?;
        state(&lab, (true, true)).context("b2 never came back")?;
    }
    lab.agent.check_alive()?;
    let us: Vec<f64> = lab.status().context("status")?.health_to_maps_us.iter().map(|&v| v as f64).collect();
    anyhow::ensure!(us.len() == 2 * TRIALS, "expected {} health changes, the agent saw {}", 2 * TRIALS, us.len());
    let Check { interval_ms, timeout_ms, fall, .. } = check;
    let bound = interval_ms * u64::from(fall) + timeout_ms;

    let mut s = Section::new(line!("Health change → maps updated (real agent, lab namespaces, {TRIALS} down + {TRIALS} up changes)"));
    let mut t = Table::new("| figure | median | p95 | max |", "|---|---:|---:|---:|");
    let a = at("health_to_maps_us");
    let [m, p, x] = Dist::of(&us).figs(&a, 1.0, 0);
    t.row(line!("| health change decided → every affected ring written | {} µs | {} µs | {} µs |", m, p, x).with(a.f("samples").data(&us)));
    let a = at("health_detect_ms");
    let [m, p, x] = Dist::of(&detect).figs(&a, 1.0, 0);
    t.row(line!(
        "| server stopped → out of the ring (interval {interval_ms}ms × fall {fall} + timeout {timeout_ms}ms = {} ms bound; 5 ms polling) | {} ms | {} ms | {} ms |",
        a.f("bound_ms").show(bound),
        m,
        p,
        x
    ));
    s.table(t);
    Ok(s)
}
