//! A VIP's frame that reaches a node's stack and is not taken there (kube-proxy
//! has not yet programmed the VIP on this node after the Service got it, so
//! nothing rewrites its destination) would be routed by the node back out of the
//! interface it came in on, to the VIP's holder. The holder balances it again,
//! maybe to this node: a loop bounded only by the IP TTL. Worse, the node's
//! conntrack keeps an entry for that 5-tuple without NAT (120 s for a SYN), so
//! the same client port meets the same fate even after kube-proxy has caught up.
//!
//! So the agent keeps one policy-routing rule per interface VIPs arrive on (the
//! pools' interfaces and the node's home), for
//! each family with VIPs (`iif IFACE lookup TABLE`, preference PRIORITY: after
//! `local`, before `main`), and a blackhole route per VIP in TABLE. Such a frame
//! is dropped at the routing decision, before conntrack confirms its entry, so
//! the client's retransmission meets the node afresh. A frame kube-proxy rewrote
//! no longer goes to the VIP and misses the table; a VIP on `lo` (`announce: lo`,
//! the config file's backends) is found in `local` first; traffic the node sends
//! itself has no input interface and never meets the rule. Rules and routes carry
//! the protocol PROTO, which is how the agent and `cleanup` tell them apart.
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use anyhow::{Context as _, Result};
use futures::TryStreamExt;
use rtnetlink::{
    packet_route::{
        route::{RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteType},
        rule::{RuleAction, RuleAttribute, RuleMessage},
        AddressFamily,
    },
    Handle, IpVersion, RouteMessageBuilder,
};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::ha::loopback::host_prefix;

/// The routing table of the blackhole routes (`ip route show table 7473`).
pub const TABLE: u32 = 7473;
/// The rules' preference (`ip rule` lists them as `7473: from all iif …`).
pub const PRIORITY: u32 = 7473;
/// The routing protocol of the rules and routes: 'v' (`ip` prints `proto 118`).
pub const PROTO: u8 = b'v';

/// What the stack must not route back: the VIPs, arriving on these interfaces.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Guard {
    pub ifaces: BTreeSet<String>,
    pub vips: BTreeSet<IpAddr>,
}

impl Guard {
    /// The rules it needs: (IPv6?, interface), for each family with a VIP.
    fn rules(&self) -> BTreeSet<(bool, String)> {
        let families: BTreeSet<bool> = self.vips.iter().map(IpAddr::is_ipv6).collect();
        families.iter().flat_map(|v6| self.ifaces.iter().map(|i| (*v6, i.clone()))).collect()
    }
}

fn ours_proto(p: &RouteProtocol) -> bool {
    u8::from(*p) == PROTO
}

/// Our rules: (IPv6?, input interface) with their message, which deleting takes.
async fn rules(h: &Handle) -> Result<Vec<((bool, String), RuleMessage)>> {
    let mut out = Vec::new();
    for version in [IpVersion::V4, IpVersion::V6] {
        let mut stream = h.rule().get(version).execute();
        while let Some(msg) = stream.try_next().await? {
            let (mut iif, mut proto, mut table) = (None, false, u32::from(msg.header.table));
            for a in &msg.attributes {
                match a {
                    RuleAttribute::Iifname(n) => iif = Some(n.clone()),
                    RuleAttribute::Protocol(p) => proto = ours_proto(p),
                    RuleAttribute::Table(t) => table = *t,
                    _ => {}
                }
            }
            if let (Some(iif), true, TABLE) = (iif, proto, table) {
                out.push(((msg.header.family == AddressFamily::Inet6, iif), msg));
            }
        }
    }
    Ok(out)
}

/// Our blackhole routes in TABLE, with their message.
async fn routes(h: &Handle) -> Result<Vec<(IpAddr, RouteMessage)>> {
    let mut out = Vec::new();
    // With strict checking (see `handle`) the kernel dumps only these: our
    // blackholes in TABLE, not the node's whole routing table every few seconds.
    let filters = [ours(RouteMessageBuilder::<Ipv4Addr>::new()), ours(RouteMessageBuilder::<Ipv6Addr>::new())];
    for filter in filters {
        let mut stream = h.route().get(filter).execute();
        while let Some(msg) = stream.try_next().await? {
            let (mut dst, mut table) = (None, u32::from(msg.header.table));
            for a in &msg.attributes {
                match a {
                    RouteAttribute::Destination(RouteAddress::Inet(v)) => dst = Some(IpAddr::V4(*v)),
                    RouteAttribute::Destination(RouteAddress::Inet6(v)) => dst = Some(IpAddr::V6(*v)),
                    RouteAttribute::Table(t) => table = *t,
                    _ => {}
                }
            }
            if let (Some(dst), TABLE, true) = (dst, table, ours_proto(&msg.header.protocol)) {
                if msg.header.destination_prefix_length == host_prefix(dst) {
                    out.push((dst, msg));
                }
            }
        }
    }
    Ok(out)
}

/// A blackhole route of ours in TABLE, to what `b` has been given.
fn ours<T>(b: RouteMessageBuilder<T>) -> RouteMessage {
    b.table_id(TABLE).kind(RouteType::BlackHole).protocol(RouteProtocol::from(PROTO)).build()
}

fn blackhole(vip: IpAddr) -> RouteMessage {
    match vip {
        IpAddr::V4(v) => ours(RouteMessageBuilder::<Ipv4Addr>::new().destination_prefix(v, host_prefix(vip))),
        IpAddr::V6(v) => ours(RouteMessageBuilder::<Ipv6Addr>::new().destination_prefix(v, host_prefix(vip))),
    }
}

/// Makes our rules and routes equal to what `want` needs. Routes first and rules
/// last when adding, the other way round when removing: a rule never sends
/// lookups to a table being filled or emptied (a miss there falls through anyway).
pub async fn sync(h: &Handle, want: &Guard) -> Result<()> {
    let have_routes = routes(h).await?;
    let have: BTreeSet<IpAddr> = have_routes.iter().map(|(v, _)| *v).collect();
    for vip in want.vips.difference(&have) {
        h.route().add(blackhole(*vip)).execute().await.with_context(|| format!("adding the blackhole route of {vip} to table {TABLE}"))?;
    }
    let want_rules = want.rules();
    let have_rules = rules(h).await?;
    let have: BTreeSet<(bool, String)> = have_rules.iter().map(|(k, _)| k.clone()).collect();
    for (v6, iif) in want_rules.difference(&have) {
        let mut req = h.rule().add().input_interface(iif.clone()).table_id(TABLE).priority(PRIORITY).action(RuleAction::ToTable);
        req.message_mut().attributes.push(RuleAttribute::Protocol(RouteProtocol::from(PROTO)));
        let res = if *v6 { req.v6().execute().await } else { req.v4().execute().await };
        res.with_context(|| format!("adding the rule iif {iif} lookup {TABLE} ({})", if *v6 { "IPv6" } else { "IPv4" }))?;
        info!(iface = %iif, ipv6 = v6, table = TABLE, "VIP frames that the stack does not take on this interface are dropped, not routed back");
    }
    for (k, msg) in have_rules {
        if !want_rules.contains(&k) {
            h.rule().del(msg).execute().await.with_context(|| format!("removing the rule iif {} lookup {TABLE}", k.1))?;
        }
    }
    for (vip, msg) in have_routes {
        if !want.vips.contains(&vip) {
            h.route().del(msg).execute().await.with_context(|| format!("removing the blackhole route of {vip} from table {TABLE}"))?;
        }
    }
    Ok(())
}

/// Removes every rule and route of ours (uninstalling); returns how many of each.
pub async fn remove_ours(h: &Handle) -> Result<(usize, usize)> {
    let (rules, routes) = (rules(h).await?, routes(h).await?);
    let counts = (rules.len(), routes.len());
    for (k, msg) in rules {
        h.rule().del(msg).execute().await.with_context(|| format!("removing the rule iif {} lookup {TABLE}", k.1))?;
    }
    for (vip, msg) in routes {
        h.route().del(msg).execute().await.with_context(|| format!("removing the blackhole route of {vip} from table {TABLE}"))?;
    }
    Ok(counts)
}

/// A netlink handle on this thread's network namespace (its connection runs on
/// the current tokio runtime), with strict checking: route dumps are filtered by
/// the kernel.
pub fn handle() -> Result<Handle> {
    let (conn, handle, _) = rtnetlink::new_connection_with_strict_check().context("netlink socket")?;
    tokio::spawn(conn);
    Ok(handle)
}

/// Keeps the rules and routes equal to the latest `want`, re-checked every few
/// seconds (an interface renamed, a rule removed by hand). Failures are logged
/// once until they change: the data path works without them, only the loop
/// above is no longer stopped.
pub fn spawn(mut want: watch::Receiver<Guard>) -> Result<()> {
    let handle = handle()?;
    tokio::spawn(async move {
        let mut last_err = String::new();
        loop {
            let cur = want.borrow_and_update().clone();
            match sync(&handle, &cur).await {
                Ok(()) => last_err.clear(),
                Err(e) => {
                    let e = format!("{e:#}");
                    if e != last_err {
                        warn!("the routing rule that keeps VIP frames from being routed back: {e}");
                        last_err = e;
                    }
                }
            }
            tokio::select! {
                r = want.changed() => if r.is_err() { return },
                _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_for_each_family_with_vips_on_each_interface() {
        let g = |ifaces: &[&str], vips: &[&str]| Guard {
            ifaces: ifaces.iter().map(|s| s.to_string()).collect(),
            vips: vips.iter().map(|v| v.parse().unwrap()).collect(),
        };
        assert!(g(&["eth0"], &[]).rules().is_empty());
        assert_eq!(g(&["eth0", "eth0.100"], &["198.18.0.200"]).rules(), BTreeSet::from([(false, "eth0".into()), (false, "eth0.100".into())]));
        assert_eq!(g(&["eth0"], &["198.18.0.200", "2001:2::200"]).rules(), BTreeSet::from([(false, "eth0".into()), (true, "eth0".into())]));
    }
}
