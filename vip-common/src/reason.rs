//! Why the data path returned what it returned: the index of each `lb_stats`
//! counter. The agent reads the counters by these names; what each one means
//! for an operator is written where docs/reference/reasons.md is generated.

/// One list of the reasons: the enum, [`Reason::ALL`] and [`Reason::name`]. Each
/// keeps its number for good: the number indexes the pinned `lb_stats`, which an
/// agent of another release reads.
macro_rules! reasons {
    ($($variant:ident = $index:literal => $name:literal,)*) => {
        /// Index into `lb_stats`: why the program returned what it returned.
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Reason {
            $($variant = $index,)*
        }

        impl Reason {
            pub const ALL: [Reason; [$($index),*].len()] = [$(Reason::$variant),*];
            pub const COUNT: u32 = Self::ALL.len() as u32;

            /// The counter's name (the metrics' `reason` label).
            pub const fn name(self) -> &'static str {
                match self {
                    $(Reason::$variant => $name,)*
                }
            }
        }
    };
}

reasons! {
    ArpAnswered = 0 => "arp_answered",
    ArpNotHeld = 1 => "arp_not_held",
    ArpStale = 2 => "arp_stale",
    ArpOther = 3 => "arp_other",
    Forwarded = 4 => "forwarded",
    PassedLocalBackend = 5 => "passed_local_backend",
    PassedNotVip = 6 => "passed_not_vip",
    PassedNotOwner = 7 => "passed_not_owner",
    PassedIcmp = 8 => "passed_icmp",
    PassedFragmentNoService = 9 => "passed_fragment_no_service",
    DropMalformed = 10 => "drop_malformed",
    DropNoBackend = 11 => "drop_no_backend",
    FlowRehashed = 12 => "flow_rehashed",
    PassedOther = 13 => "passed_other",
    ArpConflict = 14 => "arp_conflict",
    ArpNotAnnounced = 15 => "arp_not_announced",
    DropGroupNotOwner = 16 => "drop_group_not_owner",
    PassedVlanOther = 17 => "passed_vlan_other",
    ForwardedHome = 18 => "forwarded_home",
    NdpAnswered = 19 => "ndp_answered",
    NdpNotHeld = 20 => "ndp_not_held",
    NdpStale = 21 => "ndp_stale",
    NdpOther = 22 => "ndp_other",
    NdpInvalid = 23 => "ndp_invalid",
    NdpConflict = 24 => "ndp_conflict",
    NdpNotAnnounced = 25 => "ndp_not_announced",
    ArpWatched = 26 => "arp_watched",
    PassedIpv6Ext = 27 => "passed_ipv6_ext",
    FlowEvicted = 28 => "flow_evicted",
    ForwardedIcmpError = 29 => "forwarded_icmp_error",
    AskedPrevious = 30 => "asked_previous",
    AskAnsweredPinned = 31 => "ask_answered_pinned",
    AskAnsweredRing = 32 => "ask_answered_ring",
    PassedFromPrevious = 33 => "passed_from_previous",
    PassedOtherHost = 34 => "passed_other_host",
}

// The numbers run 0..COUNT, so `ALL[i] as u32 == i` and `lb_stats` has no gap.
const _: () = {
    let mut i = 0;
    while i < Reason::ALL.len() {
        assert!(Reason::ALL[i] as usize == i);
        i += 1;
    }
};

impl Reason {
    /// What the program does with a frame counted under this reason.
    pub const fn verdict(self) -> &'static str {
        match self {
            Reason::ArpAnswered | Reason::Forwarded | Reason::NdpAnswered | Reason::AskedPrevious => "XDP_TX",
            Reason::AskAnsweredPinned | Reason::AskAnsweredRing => "XDP_TX, XDP_REDIRECT or XDP_PASS",
            Reason::ForwardedHome | Reason::ForwardedIcmpError => "XDP_TX or XDP_REDIRECT",
            Reason::DropMalformed | Reason::DropNoBackend | Reason::ArpNotAnnounced | Reason::DropGroupNotOwner => "XDP_DROP",
            Reason::FlowRehashed | Reason::FlowEvicted => "(an event, counted besides the verdict)",
            Reason::ArpNotHeld
            | Reason::ArpStale
            | Reason::ArpOther
            | Reason::PassedLocalBackend
            | Reason::PassedNotVip
            | Reason::PassedNotOwner
            | Reason::PassedIcmp
            | Reason::PassedFragmentNoService
            | Reason::PassedOther
            | Reason::ArpConflict
            | Reason::PassedVlanOther
            | Reason::NdpNotHeld
            | Reason::NdpStale
            | Reason::NdpOther
            | Reason::NdpInvalid
            | Reason::NdpConflict
            | Reason::NdpNotAnnounced
            | Reason::ArpWatched
            | Reason::PassedIpv6Ext
            | Reason::PassedFromPrevious
            | Reason::PassedOtherHost => "XDP_PASS",
        }
    }
}
