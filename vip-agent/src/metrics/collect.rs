//! Metric families computed at scrape time: the data path's per-CPU counters,
//! summed from the pinned maps, and each peer's longest heartbeat gap (the
//! current silence counts).
use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Arc, Mutex, RwLock},
    time::Instant,
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};
use tracing::warn;

use super::{Names, NodeLabels, ServiceLabels};
use crate::{
    dataplane::Dataplane,
    ha::heartbeat::{Gaps, PeerLabels},
};

/// `vip_heartbeat_gap_max_seconds`, computed at scrape time (the current silence counts).
#[derive(Debug)]
pub(super) struct GapCollector(pub(super) Gaps);

impl Collector for GapCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let gaps = self.0.max_at(Instant::now());
        let help = format!(
            "Longest time without a heartbeat from each peer over the last {} s, the current silence included",
            crate::ha::heartbeat::GAP_WINDOW.as_secs()
        );
        let mut fam = enc.encode_descriptor("vip_heartbeat_gap_max_seconds", &help, None, ConstGauge::new(0.0).metric_type())?;
        for (peer, g) in gaps {
            ConstGauge::new(g).encode(fam.encode_family(&PeerLabels { peer })?)?;
        }
        Ok(())
    }
}

/// The data path's per-CPU counters, summed at scrape time from the pinned maps.
#[derive(Debug)]
pub struct BpfCounters {
    pin_dir: PathBuf,
    /// Opened lazily (and again after an error): the maps may be re-created.
    dp: Mutex<Option<DebugDp>>,
    names: Arc<RwLock<Names>>,
}

struct DebugDp(Dataplane);
impl std::fmt::Debug for DebugDp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Dataplane")
    }
}

impl BpfCounters {
    pub fn new(pin_dir: PathBuf, names: Arc<RwLock<Names>>) -> Self {
        Self { pin_dir, dp: Mutex::new(None), names }
    }
}

fn const_counter_family<L: EncodeLabelSet>(enc: &mut DescriptorEncoder, name: &str, help: &str, rows: impl Iterator<Item = (L, u64)>) -> std::fmt::Result {
    let mut rows = rows.peekable();
    if rows.peek().is_none() {
        return Ok(());
    }
    let mut fam = enc.encode_descriptor(name, help, None, ConstCounter::new(0u64).metric_type())?;
    for (labels, v) in rows {
        ConstCounter::new(v).encode(fam.encode_family(&labels)?)?;
    }
    Ok(())
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

impl Collector for BpfCounters {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let mut guard = self.dp.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            *guard = Dataplane::open(&self.pin_dir).ok().map(DebugDp);
        }
        let Some(dp) = guard.as_ref() else { return Ok(()) };
        let c = match dp.0.counters() {
            Ok(c) => c,
            Err(e) => {
                warn!("reading BPF counters: {e:#}");
                *guard = None;
                return Ok(());
            }
        };
        let names = self.names.read().unwrap_or_else(|e| e.into_inner());
        encode_counters(&mut enc, &c, &names)
    }
}

/// The data path's counters as metric families (at scrape time, and for the
/// reference). Services and backends are labelled with what the agent named
/// them (ids are re-used); those it has not named (yet) are left out.
pub(crate) fn encode_counters(enc: &mut DescriptorEncoder, c: &crate::dataplane::Counters, names: &Names) -> std::fmt::Result {
    let reason = |(r, v): (&&'static str, &(u64, u64)), bytes: bool| (ReasonLabels { reason: (*r).to_owned() }, if bytes { v.1 } else { v.0 });
    const_counter_family(enc, "vip_xdp_packets", "Packets seen by the XDP program, by reason", c.reasons.iter().map(|x| reason(x, false)))?;
    const_counter_family(enc, "vip_xdp_bytes", "Bytes seen by the XDP program, by reason", c.reasons.iter().map(|x| reason(x, true)))?;
    let services = labelled(&c.services, |id| {
        let a = c.service_addrs.get(&id)?;
        Some(ServiceLabels::new(names.services.get(a)?, a))
    });
    let backends = labelled(&c.backends, |id| Some(NodeLabels { node: names.nodes.get(c.backend_addrs.get(&id)?)?.clone() }));
    const_counter_family(enc, "vip_service_packets", "Packets balanced per service-port", rows(&services, false))?;
    const_counter_family(enc, "vip_service_bytes", "Bytes balanced per service-port", rows(&services, true))?;
    const_counter_family(enc, "vip_backend_packets", "Packets sent to each backend node", rows(&backends, false))?;
    const_counter_family(enc, "vip_backend_bytes", "Bytes sent to each backend node", rows(&backends, true))?;
    Ok(())
}

/// The packets (or bytes) of each label set.
fn rows<L: Clone>(m: &BTreeMap<L, (u64, u64)>, bytes: bool) -> impl Iterator<Item = (L, u64)> + '_ {
    m.iter().map(move |(l, v)| (l.clone(), if bytes { v.1 } else { v.0 }))
}

/// Per-id counters summed under the labels `name` gives each id.
fn labelled<L: Ord>(by_id: &BTreeMap<u32, (u64, u64)>, name: impl Fn(u32) -> Option<L>) -> BTreeMap<L, (u64, u64)> {
    let mut out: BTreeMap<L, (u64, u64)> = BTreeMap::new();
    for (id, (p, b)) in by_id {
        if let Some(l) = name(*id) {
            let e = out.entry(l).or_default();
            *e = (e.0 + p, e.1 + b);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use prometheus_client::registry::Registry;

    use super::*;
    use crate::{
        metrics::testing::{scrape, series},
        model::{Protocol, ServiceAddr},
    };

    #[test]
    fn data_path_counters_are_labelled_by_name_never_by_id() {
        let web = ServiceAddr { vip: "198.18.1.1".parse().unwrap(), port: 80, protocol: Protocol::Tcp };
        let dns = ServiceAddr { vip: "198.18.1.1".parse().unwrap(), port: 53, protocol: Protocol::Udp };
        let (b1, b2): (Ipv4Addr, Ipv4Addr) = ("198.18.0.11".parse().unwrap(), "198.18.0.12".parse().unwrap());
        let c = crate::dataplane::Counters {
            reasons: [("forwarded", (5, 500))].into(),
            // Id 9: a service another agent left, not named by this one.
            services: [(3, (7, 700)), (4, (1, 100)), (9, (2, 200))].into(),
            backends: [(0, (4, 400)), (1, (3, 300))].into(),
            service_addrs: [(3, web), (4, dns), (9, ServiceAddr { port: 443, ..web })].into(),
            backend_addrs: [(0, b1), (1, b2)].into(),
        };
        let names =
            Names { services: [(web, "default/web".into()), (dns, "kube-system/dns".into())].into(), nodes: [(b1, "b1".into()), (b2, "b2".into())].into() };
        #[derive(Debug)]
        struct C(crate::dataplane::Counters, Arc<RwLock<Names>>);
        impl Collector for C {
            fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
                encode_counters(&mut enc, &self.0, &self.1.read().unwrap())
            }
        }
        let names = Arc::new(RwLock::new(names));
        let mut r = Registry::default();
        r.register_collector(Box::new(C(c, names.clone())));
        let t = scrape(&r);
        assert!(t.contains(r#"vip_service_packets_total{service="default/web",vip="198.18.1.1",port="80",protocol="tcp"} 7"#), "{t}");
        assert!(t.contains(r#"vip_service_bytes_total{service="kube-system/dns",vip="198.18.1.1",port="53",protocol="udp"} 100"#), "{t}");
        assert_eq!(series(&t, "vip_service_packets_total").len(), 2, "the unnamed id is left out: {t}");
        assert!(t.contains(r#"vip_backend_packets_total{node="b1"} 4"#) && t.contains(r#"vip_backend_bytes_total{node="b2"} 300"#), "{t}");
        assert!(!t.contains("id="), "{t}");
        // The service goes from the agent's names: its series goes.
        names.write().unwrap().services.remove(&web);
        let t = scrape(&r);
        assert!(!t.contains("default/web"), "{t}");
    }
}
