//! `announce: lo`: the holder of such a VIP adds it to the loopback (/32, label
//! `lo:vip`) for a routing daemon on the node (BGP/ECMP) to announce, and removes
//! it when it no longer holds it. The label marks our addresses: an address that
//! someone else put on `lo` is never removed.
use std::{collections::BTreeSet, net::Ipv4Addr, time::Duration};

use anyhow::{anyhow, Context as _, Result};
use futures::TryStreamExt;
use rtnetlink::{
    packet_route::address::{AddressAttribute, AddressMessage},
    Handle,
};
use tokio::sync::watch;
use tracing::{info, warn};

/// The label of the addresses the agent manages on `lo`.
pub const LABEL: &str = "lo:vip";

/// VIPs on `lo`: every IPv4 address, and those with our label (with their message,
/// which deleting them takes).
async fn addresses(h: &Handle, lo: u32) -> Result<(BTreeSet<Ipv4Addr>, Vec<(Ipv4Addr, AddressMessage)>)> {
    let mut all = BTreeSet::new();
    let mut ours = Vec::new();
    let mut stream = h.address().get().set_link_index_filter(lo).execute();
    while let Some(msg) = stream.try_next().await? {
        let mut addr = None;
        let mut label = None;
        for a in &msg.attributes {
            match a {
                AddressAttribute::Local(std::net::IpAddr::V4(v)) => addr = Some(*v),
                AddressAttribute::Address(std::net::IpAddr::V4(v)) if addr.is_none() => addr = Some(*v),
                AddressAttribute::Label(l) => label = Some(l.clone()),
                _ => {}
            }
        }
        let Some(addr) = addr else { continue };
        all.insert(addr);
        if label.as_deref() == Some(LABEL) && msg.header.prefix_len == 32 {
            ours.push((addr, msg));
        }
    }
    Ok((all, ours))
}

/// Makes our labelled addresses on `lo` equal to `want`.
pub async fn sync(h: &Handle, lo: u32, want: &BTreeSet<Ipv4Addr>) -> Result<()> {
    let (all, ours) = addresses(h, lo).await?;
    for vip in want.difference(&all) {
        let mut req = h.address().add(lo, (*vip).into(), 32);
        req.message_mut().attributes.push(AddressAttribute::Label(LABEL.into()));
        req.execute().await.with_context(|| format!("adding {vip}/32 to lo"))?;
        info!(%vip, "VIP added to lo for the routing daemon to announce");
    }
    for (vip, msg) in ours {
        if !want.contains(&vip) {
            h.address().del(msg).execute().await.with_context(|| format!("removing {vip}/32 from lo"))?;
            info!(%vip, "VIP removed from lo");
        }
    }
    Ok(())
}

/// Removes every address of ours from `lo` (uninstalling); returns them.
pub async fn remove_ours(h: &Handle, lo: u32) -> Result<Vec<Ipv4Addr>> {
    let (_, ours) = addresses(h, lo).await?;
    let mut removed = Vec::new();
    for (vip, msg) in ours {
        h.address().del(msg).execute().await.with_context(|| format!("removing {vip}/32 from lo"))?;
        removed.push(vip);
    }
    Ok(removed)
}

/// Keeps `lo` equal to the latest `want` (also re-checked every few seconds, in
/// case an address was removed by hand). With `want` empty from the start and
/// nothing of ours on `lo`, it does nothing.
pub fn spawn(mut want: watch::Receiver<BTreeSet<Ipv4Addr>>) -> Result<()> {
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
