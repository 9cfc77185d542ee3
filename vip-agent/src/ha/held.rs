//! What the node's VIPs look like once held: the view the VipStatus writer
//! (`k8s::vipstatus`) and the status share with the liveness thread that holds them.
use std::time::SystemTime;

use super::arpcheck::ArpCheck;

/// A VIP this node holds, as its `VipStatus` shows it (`k8s::vipstatus`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldVip {
    /// When this agent took it (or found it held, at its start).
    pub since: SystemTime,
    /// Its last gratuitous ARP (None: not announced by ARP).
    pub last_garp: Option<SystemTime>,
    /// Where it is answered: the interface (a VLAN's parent for a pool's `vlan`), and the VLAN.
    pub interface: String,
    pub vlan: Option<u16>,
    /// Whether this agent found it held at its start (by this node's agent before
    /// it, without a gap): `since` is then this agent's start, and the VIP's
    /// status keeps the take-over time it already shows.
    pub adopted: bool,
    /// What the last ARP self-check from a peer saw (None: none yet).
    pub arp: Option<ArpCheck>,
}
