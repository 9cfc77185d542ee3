//! Sets of IPv4 and IPv6 addresses kept as sorted, disjoint inclusive ranges: an
//! IPv6 pool of a /64 is one range, never 2^64 addresses in memory. Lookups are
//! binary searches; the first free address is found by walking past the used ones.
use std::{
    collections::BTreeSet,
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

/// An address family, in the words Kubernetes uses (`spec.ipFamilies`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(a: IpAddr) -> Self {
        if a.is_ipv4() {
            Family::V4
        } else {
            Family::V6
        }
    }

    /// `IPv4` / `IPv6`, as in a Service's `spec.ipFamilies`.
    pub fn name(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "IPv4" => Some(Family::V4),
            "IPv6" => Some(Family::V6),
            _ => None,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `address:port` for people, as std's `SocketAddr` writes it: an IPv6 address
/// in brackets (`198.18.1.10:80`, `[2001:db8::1]:80`). `port` may be any text
/// where a number does not say it (`inspect`'s `*fragments`).
pub fn host_port(ip: IpAddr, port: impl fmt::Display) -> String {
    match ip {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

/// An address as a number within its family, ordered IPv4 before IPv6.
type Key = (Family, u128);

fn key(a: IpAddr) -> Key {
    match a {
        IpAddr::V4(v) => (Family::V4, u32::from(v).into()),
        IpAddr::V6(v) => (Family::V6, v.into()),
    }
}

fn addr((f, n): Key) -> IpAddr {
    match f {
        Family::V4 => IpAddr::V4(Ipv4Addr::from(n as u32)),
        Family::V6 => IpAddr::V6(Ipv6Addr::from(n)),
    }
}

/// A set of addresses of either family, as inclusive ranges.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AddrSet {
    /// Sorted, disjoint and not adjacent (merged); each range within one family.
    ranges: Vec<(Key, Key)>,
}

impl AddrSet {
    /// Adds `lo..=hi`. Panics when the bounds are of different families or reversed
    /// (callers parse them as `spec::AddrEntry`, which refuses both).
    pub fn insert_range(&mut self, lo: IpAddr, hi: IpAddr) {
        let (mut lo, mut hi) = (key(lo), key(hi));
        assert!(lo.0 == hi.0 && lo <= hi, "a range within one family, in order");
        // Every range that overlaps or touches [lo, hi] is merged into it (the
        // ranges are apart, so none touches the merged one but not [lo, hi]).
        let (l, h) = (lo, hi);
        let touches = |r: &(Key, Key)| r.0 .0 == l.0 && r.0 .1 <= h.1.saturating_add(1) && l.1 <= r.1 .1.saturating_add(1);
        let start = self.ranges.partition_point(|r| r.1 < lo && !touches(r));
        let mut end = start;
        while end < self.ranges.len() && touches(&self.ranges[end]) {
            lo = lo.min(self.ranges[end].0);
            hi = hi.max(self.ranges[end].1);
            end += 1;
        }
        self.ranges.splice(start..end, [(lo, hi)]);
    }

    pub fn insert(&mut self, a: IpAddr) {
        self.insert_range(a, a);
    }

    fn find(&self, k: Key) -> Option<usize> {
        let i = self.ranges.partition_point(|r| r.1 < k);
        (i < self.ranges.len() && self.ranges[i].0 <= k).then_some(i)
    }

    pub fn contains(&self, a: IpAddr) -> bool {
        self.find(key(a)).is_some()
    }

    /// Removes `a`; false when it was not in the set.
    pub fn remove(&mut self, a: IpAddr) -> bool {
        let k = key(a);
        let Some(i) = self.find(k) else { return false };
        let (lo, hi) = self.ranges[i];
        let mut rest = Vec::with_capacity(2);
        if lo < k {
            rest.push((lo, (k.0, k.1 - 1)));
        }
        if k < hi {
            rest.push(((k.0, k.1 + 1), hi));
        }
        self.ranges.splice(i..=i, rest);
        true
    }

    /// Removes every address of `lo..=hi`; false (and nothing removed) unless all of
    /// them are in the set.
    pub fn remove_range(&mut self, lo: IpAddr, hi: IpAddr) -> bool {
        let (lo, hi) = (key(lo), key(hi));
        let Some(i) = self.find(lo) else { return false };
        let (a, b) = self.ranges[i];
        if b < hi || lo.0 != hi.0 {
            return false;
        }
        let mut rest = Vec::with_capacity(2);
        if a < lo {
            rest.push((a, (lo.0, lo.1 - 1)));
        }
        if hi < b {
            rest.push(((hi.0, hi.1 + 1), b));
        }
        self.ranges.splice(i..=i, rest);
        true
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// How many addresses (an IPv6 /64 alone is 2^64).
    pub fn len(&self) -> u128 {
        self.ranges.iter().map(|(lo, hi)| (hi.1 - lo.1).saturating_add(1)).fold(0u128, u128::saturating_add)
    }

    /// How many addresses of `family`.
    pub fn len_of(&self, family: Family) -> u128 {
        self.ranges.iter().filter(|r| r.0 .0 == family).map(|(lo, hi)| (hi.1 - lo.1).saturating_add(1)).fold(0u128, u128::saturating_add)
    }

    /// The families the set has addresses of (IPv4 first).
    pub fn families(&self) -> BTreeSet<Family> {
        self.ranges.iter().map(|r| r.0 .0).collect()
    }

    /// The ranges, as (first, last) addresses.
    pub fn ranges(&self) -> impl Iterator<Item = (IpAddr, IpAddr)> + '_ {
        self.ranges.iter().map(|&(lo, hi)| (addr(lo), addr(hi)))
    }

    /// Every address, lowest first, lazily (do not collect an IPv6 prefix).
    pub fn iter(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.ranges.iter().flat_map(|&(lo, hi)| (lo.1..=hi.1).map(move |n| addr((lo.0, n))))
    }

    /// The IPv4 addresses, lowest first (the data path's, which holds IPv4 only).
    pub fn v4(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        self.iter().map_while(|a| match a {
            IpAddr::V4(v) => Some(v),
            IpAddr::V6(_) => None,
        })
    }

    /// The lowest address of `family` not in `used` (cost: the used addresses
    /// walked past, never the size of the set).
    pub fn first_free(&self, family: Family, used: &BTreeSet<IpAddr>) -> Option<IpAddr> {
        for &(lo, hi) in self.ranges.iter().filter(|r| r.0 .0 == family) {
            let mut k = lo;
            for u in used.range(addr(lo)..=addr(hi)) {
                if key(*u) != k {
                    break;
                }
                if k == hi {
                    break;
                }
                k.1 += 1;
            }
            if !used.contains(&addr(k)) {
                return Some(addr(k));
            }
        }
        None
    }

    /// The lowest address in both sets.
    pub fn first_common(&self, other: &AddrSet) -> Option<IpAddr> {
        let (mut i, mut j) = (0, 0);
        while i < self.ranges.len() && j < other.ranges.len() {
            let (a, b) = (self.ranges[i], other.ranges[j]);
            let lo = a.0.max(b.0);
            if lo <= a.1.min(b.1) {
                return Some(addr(lo));
            }
            if a.1 < b.1 {
                i += 1;
            } else {
                j += 1;
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_brackets_ipv6_as_socket_addr_does() {
        for (ip, want) in [("198.18.1.10", "198.18.1.10:80"), ("2001:2::1", "[2001:2::1]:80"), ("::ffff:198.18.1.10", "[::ffff:198.18.1.10]:80")] {
            let ip: IpAddr = ip.parse().unwrap();
            assert_eq!(host_port(ip, 80), want);
            assert_eq!(host_port(ip, 80), std::net::SocketAddr::new(ip, 80).to_string());
        }
        assert_eq!(host_port("2001:2::1".parse().unwrap(), "*fragments"), "[2001:2::1]:*fragments");
    }

    type Ranges<'a> = &'a [(&'a str, &'a str)];

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn set(ranges: &[(&str, &str)]) -> AddrSet {
        let mut s = AddrSet::default();
        for (a, b) in ranges {
            s.insert_range(ip(a), ip(b));
        }
        s
    }

    fn shown(s: &AddrSet) -> Vec<String> {
        s.ranges().map(|(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") }).collect()
    }

    #[test]
    fn inserts_merge_overlapping_and_adjacent_ranges_per_family() {
        let cases: &[(Ranges, &[&str])] = &[
            (&[("198.18.1.1", "198.18.1.5"), ("198.18.1.6", "198.18.1.9")], &["198.18.1.1-198.18.1.9"]),
            (&[("198.18.1.5", "198.18.1.9"), ("198.18.1.1", "198.18.1.6")], &["198.18.1.1-198.18.1.9"]),
            (&[("198.18.1.1", "198.18.1.2"), ("198.18.1.8", "198.18.1.9"), ("198.18.1.3", "198.18.1.7")], &["198.18.1.1-198.18.1.9"]),
            (&[("198.18.1.1", "198.18.1.2"), ("198.18.1.4", "198.18.1.4")], &["198.18.1.1-198.18.1.2", "198.18.1.4"]),
            // 255.255.255.255 and :: are numerically adjacent but not of one family.
            (&[("::", "::1"), ("255.255.255.254", "255.255.255.255")], &["255.255.255.254-255.255.255.255", "::-::1"]),
            (&[("2001:2::", "2001:2::ffff:ffff:ffff:ffff"), ("2001:2:0:1::", "2001:2:0:1::")], &["2001:2::-2001:2:0:1::"]),
            (&[("2001:2::", "2001:2::ffff:ffff:ffff:ffff"), ("2001:2::1:0:0:0", "2001:2::1:0:0:0")], &["2001:2::-2001:2::ffff:ffff:ffff:ffff"]),
            (
                &[("ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"), ("::", "::")],
                &["::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe-ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"],
            ),
        ];
        for (input, want) in cases {
            assert_eq!(shown(&set(input)), *want, "{input:?}");
        }
    }

    #[test]
    fn a_slash_64_is_one_range_and_counts_without_expanding() {
        let s = set(&[("2001:2::", "2001:2::ffff:ffff:ffff:ffff"), ("198.18.1.0", "198.18.1.255")]);
        assert_eq!(s.len(), (1u128 << 64) + 256);
        assert_eq!((s.len_of(Family::V4), s.len_of(Family::V6)), (256, 1u128 << 64));
        assert!(s.contains(ip("2001:2::abcd")) && !s.contains(ip("2001:2:0:1::")) && s.contains(ip("198.18.1.7")));
        assert_eq!(s.families().into_iter().collect::<Vec<_>>(), [Family::V4, Family::V6]);
        assert_eq!(s.v4().count(), 256);
        let all = AddrSet { ranges: vec![((Family::V6, 0), (Family::V6, u128::MAX))] };
        assert_eq!(all.len(), u128::MAX, "saturates");
    }

    #[test]
    fn removals_split_ranges() {
        let mut s = set(&[("2001:2::", "2001:2::ffff:ffff:ffff:ffff")]);
        assert!(s.remove(ip("2001:2::")));
        assert!(!s.remove(ip("2001:2::")), "already gone");
        assert!(s.remove(ip("2001:2::8")));
        assert!(s.remove_range(ip("2001:2::100"), ip("2001:2::1ff")));
        assert!(!s.remove_range(ip("2001:2::1fe"), ip("2001:2::200")), "partly outside: refused");
        assert_eq!(shown(&s), ["2001:2::1-2001:2::7", "2001:2::9-2001:2::ff", "2001:2::200-2001:2::ffff:ffff:ffff:ffff"]);
        assert!(!s.remove(ip("198.18.1.1")));
        let mut s = set(&[("198.18.1.1", "198.18.1.1")]);
        assert!(s.remove(ip("198.18.1.1")) && s.is_empty());
    }

    #[test]
    fn first_free_walks_past_used_addresses_only() {
        let s = set(&[("198.18.1.10", "198.18.1.11"), ("198.18.1.20", "198.18.1.20"), ("2001:2::", "2001:2::ffff:ffff:ffff:ffff")]);
        let used = |xs: &[&str]| xs.iter().map(|x| ip(x)).collect::<BTreeSet<_>>();
        let cases: &[(Family, &[&str], Option<&str>)] = &[
            (Family::V4, &[], Some("198.18.1.10")),
            (Family::V4, &["198.18.1.10"], Some("198.18.1.11")),
            (Family::V4, &["198.18.1.10", "198.18.1.11"], Some("198.18.1.20")),
            (Family::V4, &["198.18.1.10", "198.18.1.11", "198.18.1.20"], None),
            (Family::V4, &["198.18.1.11", "2001:2::"], Some("198.18.1.10")),
            (Family::V6, &["198.18.1.10"], Some("2001:2::")),
            (Family::V6, &["2001:2::", "2001:2::1", "2001:2::3"], Some("2001:2::2")),
        ];
        for (f, u, want) in cases {
            assert_eq!(s.first_free(*f, &used(u)), want.map(ip), "{f} {u:?}");
        }
        assert_eq!(AddrSet::default().first_free(Family::V6, &BTreeSet::new()), None);
        // A fully used IPv4 range next to a free one of the same family.
        let s = set(&[("198.18.1.1", "198.18.1.1"), ("198.18.1.3", "198.18.1.3")]);
        assert_eq!(s.first_free(Family::V4, &used(&["198.18.1.1"])), Some(ip("198.18.1.3")));
    }

    #[test]
    fn first_common_finds_overlaps() {
        let a = set(&[("198.18.1.1", "198.18.1.5"), ("2001:2::10", "2001:2::20")]);
        let cases: &[(Ranges, Option<&str>)] = &[
            (&[("198.18.1.6", "198.18.1.9")], None),
            (&[("198.18.1.5", "198.18.1.9")], Some("198.18.1.5")),
            (&[("198.18.0.0", "198.18.255.255")], Some("198.18.1.1")),
            (&[("2001:2::", "2001:2::ffff")], Some("2001:2::10")),
            (&[("::c612:101", "::c612:105")], None),
        ];
        for (b, want) in cases {
            assert_eq!(a.first_common(&set(b)), want.map(ip), "{b:?}");
            assert_eq!(set(b).first_common(&a), want.map(ip), "{b:?} reversed");
        }
    }
}
