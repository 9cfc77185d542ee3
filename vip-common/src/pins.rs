//! The pinned maps' names. A map is pinned under the agent's bpffs directory by
//! its name, and an agent that starts reuses what it finds there: these names and
//! the layouts behind them are the contract between agents of different releases
//! on one node (an upgrade, a rollback), so they keep their historical names even
//! where a map now serves both families (`lb4_ring`, `lb4_backends`). The data
//! path's `#[map]` definitions are checked against [`map_names::ALL`] (the agent's
//! `dataplane` tests read the object's maps).

/// One list of the pinned maps: each name's constant and [`map_names::ALL`].
macro_rules! pinned_maps {
    ($($name:ident = $pin:literal,)*) => {
        $(pub const $name: &str = $pin;)*
        /// Every pinned map, in the order `inspect` and the tests list them.
        pub const ALL: [&str; [$($pin),*].len()] = [$($name),*];
    };
}

/// Map names; the agent pins each map under its bpffs directory with this name.
pub mod map_names {
    pinned_maps! {
        IFACES = "lb_ifaces",
        HELD = "arp_held",
        CONFLICTS = "arp_conflicts",
        SERVICES = "lb4_services",
        BACKENDS = "lb4_backends",
        RING = "lb4_ring",
        FLOWS = "lb_flows",
        FLOWS_CTL = "lb_flows_ctl",
        FIRST_PACKETS = "lb4_first_packets",
        STATS = "lb_stats",
        SERVICE_STATS = "lb4_service_stats",
        BACKEND_STATS = "lb4_backend_stats",
        FLOW_CACHE = "lb4_flow_cache",
        FLOW_CACHE_CTL = "lb4_flow_cache_ctl",
        VLANS = "lb_vlans",
        HOME = "lb_home",
        VIP_FILTER = "lb4_vip_filter",
        HELD6 = "ndp_held",
        CONFLICTS6 = "ndp_conflicts",
        ARP_WATCH = "arp_watch",
        SERVICES6 = "lb6_services",
        FIRST_PACKETS6 = "lb6_first_packets",
        FLOW_CACHE6 = "lb6_flow_cache",
        NODES = "lb_nodes",
        HELD_FILTER = "lb_held_filter",
        HELD_SLOTS = "lb4_held_slots",
        HELD_SLOTS6 = "lb6_held_slots",
        HANDOFF = "arp_handoff",
        HANDOFF6 = "ndp_handoff",
    }
}

/// Name of the XDP program inside the object, and of its pin.
pub const PROGRAM_NAME: &str = "vip_xdp";
/// The program that transmits the frame it is run on (BPF_PROG_RUN, live frames):
/// how the agent sends gratuitous ARP without a packet socket. Pinned, never attached.
pub const XMIT_PROGRAM_NAME: &str = "vip_xmit";
/// A frame this long (an Ethernet header and nothing after it) is dropped by
/// `vip_xmit`, not sent: the agent runs one to learn whether the kernel lets it
/// transmit through XDP at all, without putting anything on the wire.
pub const XMIT_PROBE_LEN: usize = 14;
