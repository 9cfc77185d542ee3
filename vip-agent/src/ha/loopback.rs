//! `announce: lo`: the holder of such a VIP adds it to the loopback (IPv4 /32 with
//! the label `lo:vip`, IPv6 /128) for a routing daemon on the node (BGP/ECMP) to
//! announce, and removes it when it no longer holds it. Both carry the address
//! protocol `PROTO` (IFA_PROTO); IPv6 addresses have no label, so for them that
//! mark alone says the address is ours. An address someone else put on `lo` is
//! never removed.
use std::{collections::BTreeSet, net::IpAddr, time::Duration};

use anyhow::{anyhow, Context as _, Result};
use futures::TryStreamExt;
use rtnetlink::{
    packet_route::address::{AddressAttribute, AddressFlags, AddressMessage, AddressProtocol},
    Handle,
};
use tokio::sync::watch;
use tracing::{info, warn};

/// The label of the IPv4 addresses the agent manages on `lo`.
pub const LABEL: &str = "lo:vip";
/// The address protocol (`ip address show` prints `proto 0x76`) of the addresses
/// the agent adds to `lo`: 'v'. Kernels before 5.18 ignore it, which only IPv6
/// addresses rely on (Linux with IPv6 VIPs is newer than that here).
pub const PROTO: u8 = b'v';

/// The host prefix of an address of this family.
pub(crate) fn host_prefix(a: IpAddr) -> u8 {
    if a.is_ipv4() {
        32
    } else {
        128
    }
}

/// VIPs on `lo`: every address, and ours (with their message, which deleting
/// them takes): IPv4 host addresses with our label, IPv6 ones with our protocol.
async fn addresses(h: &Handle, lo: u32) -> Result<(BTreeSet<IpAddr>, Vec<(IpAddr, AddressMessage)>)> {
    let mut all = BTreeSet::new();
    let mut ours = Vec::new();
    let mut stream = h.address().get().set_link_index_filter(lo).execute();
    while let Some(msg) = stream.try_next().await? {
        let mut addr = None;
        let mut label = None;
        let mut proto = None;
        for a in &msg.attributes {
            match a {
                AddressAttribute::Local(v) => addr = Some(*v),
                AddressAttribute::Address(v) if addr.is_none() => addr = Some(*v),
                AddressAttribute::Label(l) => label = Some(l.clone()),
                AddressAttribute::Protocol(p) => proto = Some(u8::from(*p)),
                _ => {}
            }
        }
        let Some(addr) = addr else { continue };
        all.insert(addr);
        let marked = match addr {
            IpAddr::V4(_) => label.as_deref() == Some(LABEL),
            IpAddr::V6(_) => proto == Some(PROTO),
        };
        if marked && msg.header.prefix_len == host_prefix(addr) {
            ours.push((addr, msg));
        }
    }
    Ok((all, ours))
}

/// Makes our addresses on `lo` equal to `want`.
pub async fn sync(h: &Handle, lo: u32, want: &BTreeSet<IpAddr>) -> Result<()> {
    let (all, ours) = addresses(h, lo).await?;
    for vip in want.difference(&all) {
        let len = host_prefix(*vip);
        let mut req = h.address().add(lo, *vip, len);
        let attrs = &mut req.message_mut().attributes;
        attrs.push(AddressAttribute::Protocol(AddressProtocol::from(PROTO)));
        match vip {
            IpAddr::V4(_) => attrs.push(AddressAttribute::Label(LABEL.into())),
            // No duplicate address detection: the VIP is meant to be on every
            // holder in turn, and a tentative address would not be announced.
            IpAddr::V6(_) => attrs.push(AddressAttribute::Flags(AddressFlags::Nodad)),
        }
        req.execute().await.with_context(|| format!("adding {vip}/{len} to lo"))?;
        info!(%vip, "VIP added to lo for the routing daemon to announce");
    }
    for (vip, msg) in ours {
        if !want.contains(&vip) {
            h.address().del(msg).execute().await.with_context(|| format!("removing {vip} from lo"))?;
            info!(%vip, "VIP removed from lo");
        }
    }
    Ok(())
}

/// Removes every address of ours from `lo` (uninstalling); returns them.
pub async fn remove_ours(h: &Handle, lo: u32) -> Result<Vec<IpAddr>> {
    remove_where(h, lo, |_| true).await
}

/// Removes those of our addresses on `lo` that `which` picks; returns them.
async fn remove_where(h: &Handle, lo: u32, which: impl Fn(&IpAddr) -> bool) -> Result<Vec<IpAddr>> {
    let (_, ours) = addresses(h, lo).await?;
    let mut removed = Vec::new();
    for (vip, msg) in ours.into_iter().filter(|(v, _)| which(v)) {
        h.address().del(msg).execute().await.with_context(|| format!("removing {vip} from lo"))?;
        removed.push(vip);
    }
    Ok(removed)
}

/// Removes those of `vips` that are ours from `lo`, through a netlink socket of
/// its own (an agent that stops withdraws the VIPs its peers took, so that its
/// routing daemon stops announcing them before the process ends); returns them.
pub async fn withdraw(vips: &BTreeSet<IpAddr>) -> Result<Vec<IpAddr>> {
    let lo = crate::dataplane::iface_info("lo").map(|(i, _)| i)?;
    let (conn, h, _) = rtnetlink::new_connection().context("netlink socket")?;
    tokio::spawn(conn);
    remove_where(&h, lo, |v| vips.contains(v)).await
}

/// Keeps `lo` equal to the latest `want` (also re-checked every few seconds, in
/// case an address was removed by hand). With `want` empty from the start and
/// nothing of ours on `lo`, it does nothing.
pub fn spawn(mut want: watch::Receiver<BTreeSet<IpAddr>>) -> Result<()> {
    let lo = crate::dataplane::iface_info("lo").map(|(i, _)| i).map_err(|e| anyhow!("announce: lo: {e:#}"))?;
    let (conn, handle, _) = rtnetlink::new_connection().context("netlink socket")?;
    tokio::spawn(conn);
    tokio::spawn(async move {
        loop {
            let cur = want.borrow_and_update().clone();
            if let Err(e) = sync(&handle, lo, &cur).await {
                warn!("announce on lo: {e:#}");
            }
            tokio::select! {
                r = want.changed() => if r.is_err() { return },
                _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            }
        }
    });
    Ok(())
}
