//! Is this host set up for the VIP traffic it will get? Direct server return hands
//! a backend frames addressed to the VIP: its stack must take them as its own (the
//! VIP on `lo` in file mode; kube-proxy's rules in a cluster) and must never answer
//! ARP for the VIP itself, or two MACs answer for it (`arp_ignore=1`,
//! `arp_announce=2`; kube-proxy's IPVS mode calls this `strictARP`). Nothing here
//! stops the agent: the problems are logged, shown in the status and printed by
//! `vip-agent check`.
use std::{collections::BTreeSet, net::IpAddr};

use crate::model::World;

/// What the host says about the settings that matter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostFacts {
    /// The effective `arp_ignore` on the uplink: the larger of `all` and the interface's.
    pub arp_ignore: u32,
    /// The effective `arp_announce` on the uplink, likewise.
    pub arp_announce: u32,
    /// The VIPs asked about that are addresses of this host.
    pub local: BTreeSet<IpAddr>,
}

impl HostFacts {
    /// Reads the sysctls of `iface` and which of `vips` are local, in this
    /// network namespace. A VIP is local when a socket can bind to it (on hosts with
    /// `ip_nonlocal_bind=1` every VIP looks local).
    pub fn read(iface: &str, vips: impl IntoIterator<Item = IpAddr>) -> Self {
        let sysctl = |name: &str| {
            ["all", iface]
                .iter()
                .filter_map(|scope| std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{scope}/{name}")).ok()?.trim().parse::<u32>().ok())
                .max()
                .unwrap_or(0)
        };
        let local = vips.into_iter().filter(|v| std::net::UdpSocket::bind((*v, 0)).is_ok()).collect();
        Self { arp_ignore: sysctl("arp_ignore"), arp_announce: sysctl("arp_announce"), local }
    }
}

/// How VIP traffic is taken in on a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Intake {
    /// File source: the VIP must be an address of the backend (on `lo`).
    VipOnLo,
    /// Kubernetes: kube-proxy's rules take the VIP's traffic; in IPVS mode the VIPs
    /// are on `kube-ipvs0`, which is why ARP must still be strict.
    KubeProxy,
}

/// The VIPs of the services `me` is a backend of.
pub fn backed_vips(world: &World, me: &str) -> BTreeSet<IpAddr> {
    world.services.iter().filter(|s| world.backend_candidates(s).iter().any(|n| n.name == me)).map(|s| s.vip).collect()
}

/// What is wrong with this host as a backend of `vips` (see [`backed_vips`]),
/// one sentence each (empty: ready).
pub fn problems(vips: &BTreeSet<IpAddr>, intake: Intake, iface: &str, facts: &HostFacts) -> Vec<String> {
    let mut out = Vec::new();
    if intake == Intake::VipOnLo {
        let missing: Vec<IpAddr> = vips.iter().copied().filter(|v| !facts.local.contains(v)).collect();
        if let Some(first) = missing.first() {
            let len = if first.is_ipv4() { 32 } else { 128 };
            out.push(format!(
                "{} VIP(s) this node is a backend of are not addresses of this host ({}): connections forwarded here are dropped by its stack; \
                 add each to lo (`ip addr add {first}/{len} dev lo`)",
                missing.len(),
                list(&missing)
            ));
        }
    }
    // IPv4 only: Linux answers neighbour solicitations only for the receiving
    // interface's own addresses, so an IPv6 VIP on lo is never answered.
    let local: Vec<IpAddr> = vips.iter().copied().filter(|v| v.is_ipv4() && facts.local.contains(v)).collect();
    if !local.is_empty() && (facts.arp_ignore < 1 || facts.arp_announce < 2) {
        out.push(format!(
            "arp_ignore is {} and arp_announce {} on {iface} (need 1 and 2): this host's kernel answers ARP for {} beside its holder, \
             so two MACs answer; set net.ipv4.conf.all.arp_ignore=1 and net.ipv4.conf.all.arp_announce=2 \
             (with kube-proxy in IPVS mode: strictARP: true)",
            facts.arp_ignore,
            facts.arp_announce,
            list(&local)
        ));
    }
    out
}

fn list(vips: &[IpAddr]) -> String {
    let shown: Vec<String> = vips.iter().take(5).map(|v| v.to_string()).collect();
    match vips.len() {
        n if n > 5 => format!("{}, ... {} more", shown.join(", "), n - 5),
        _ => shown.join(", "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;

    const CFG: &str = r#"
nodes:
  - {name: a, address: 198.18.0.1, mac: "02:00:00:00:00:01"}
  - {name: b, address: 198.18.0.2, mac: "02:00:00:00:00:02", labels: {web: "no"}}
pools:
  - {name: p, addresses: [198.18.1.0/30]}
services:
  - {name: web, vip: 198.18.1.1, ports: [80], backendSelector: {}}
  - {name: dns, vip: 198.18.1.2, ports: [53], protocol: udp, backendSelector: {web: "no"}}
"#;

    fn facts(ignore: u32, announce: u32, local: &[&str]) -> HostFacts {
        HostFacts { arp_ignore: ignore, arp_announce: announce, local: local.iter().map(|s| s.parse().unwrap()).collect() }
    }

    #[test]
    fn a_ready_backend_has_no_problem() {
        let w = parse(CFG).unwrap();
        assert_eq!(backed_vips(&w, "a"), ["198.18.1.1".parse().unwrap()].into());
        assert!(problems(&backed_vips(&w, "a"), Intake::VipOnLo, "eth0", &facts(1, 2, &["198.18.1.1"])).is_empty());
        assert!(problems(&backed_vips(&w, "b"), Intake::VipOnLo, "eth0", &facts(2, 2, &["198.18.1.1", "198.18.1.2"])).is_empty());
    }

    #[test]
    fn a_missing_vip_on_lo_is_named_in_file_mode_only() {
        let w = parse(CFG).unwrap();
        let p = problems(&backed_vips(&w, "b"), Intake::VipOnLo, "eth0", &facts(1, 2, &["198.18.1.1"]));
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("198.18.1.2") && p[0].contains("ip addr add 198.18.1.2/32 dev lo"), "{p:?}");
        assert!(problems(&backed_vips(&w, "b"), Intake::KubeProxy, "eth0", &facts(0, 0, &[])).is_empty());
    }

    #[test]
    fn loose_arp_with_a_local_vip_is_two_answerers() {
        let w = parse(CFG).unwrap();
        for (ignore, announce) in [(0, 2), (1, 0), (0, 0)] {
            for intake in [Intake::VipOnLo, Intake::KubeProxy] {
                let p = problems(&backed_vips(&w, "a"), intake, "eth0", &facts(ignore, announce, &["198.18.1.1"]));
                assert_eq!(p.len(), 1, "{ignore}/{announce} {intake:?}: {p:?}");
                assert!(p[0].contains("two MACs") && p[0].contains("198.18.1.1") && p[0].contains("strictARP"), "{p:?}");
            }
        }
    }
}
