use super::*;

fn spec(yaml: &str) -> VipPoolSpec {
    serde_yaml_ng::from_str(yaml).unwrap()
}

#[test]
fn valid_spec_fills_the_pool() {
    let s = spec("addresses: [198.18.1.10, 198.18.1.16/30]\nexcludedIPs: [198.18.1.17]\ntableSize: 251\nhealthCheck: {type: tcp}\n");
    assert!(s.auto_assign, "autoAssign defaults to true");
    assert_eq!(s.announce, AnnounceMode::Arp);
    let v = validate(&s, 443).unwrap();
    // .16/30 is .16 to .19: its network (.16) and broadcast (.19) are skipped, .17 excluded.
    assert_eq!(v.addresses.iter().map(|a| a.to_string()).collect::<Vec<_>>(), ["198.18.1.10", "198.18.1.18"]);
    assert_eq!(v.table_size, 251);
    assert_eq!(v.health.unwrap().probe, crate::model::Probe::Tcp { port: 443 });
    assert!(v.interfaces.is_empty(), "no interfaces: chosen by address");
    assert_eq!(v.distribution, Distribution::One, "one holder per VIP by default");
    let v = validate(&spec("addresses: [198.18.1.10]\ninterfaces: [eth1, ens4.100]\n"), 80).unwrap();
    assert_eq!(v.interfaces, ["eth1", "ens4.100"]);
    let v = validate(&spec("addresses: [198.18.1.10]\nannounce: lo\ndistribution: all\n"), 80).unwrap();
    assert_eq!((v.announce, v.distribution), (AnnounceMode::Lo, Distribution::All));
}

/// deploy/examples/pool.yaml shows `interfaces` commented out: valid once uncommented.
#[test]
fn example_pool_interfaces_are_valid() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/examples/pool.yaml")).unwrap();
    assert!(text.contains("\n  # interfaces: ["), "the example shows a pool's interfaces");
    let pool: VipPool = serde_yaml_ng::from_str(&text.replace("\n  # interfaces: ", "\n  interfaces: ")).unwrap();
    assert_eq!(validate(&pool.spec, 80).unwrap().interfaces, ["eth0", "ens3", "eno1.100"]);
}

#[test]
fn cidrs_skip_network_and_broadcast_unless_asked() {
    let ips = |y: &str| validate(&spec(y), 80).map(|v| v.addresses.iter().map(|a| a.to_string()).collect::<Vec<_>>());
    let v = ips("addresses: [198.18.1.0/24]\n").unwrap();
    assert_eq!((v.len(), v[0].as_str(), v[253].as_str()), (254, "198.18.1.1", "198.18.1.254"));
    assert_eq!(ips("addresses: [198.18.1.0/24]\nincludeNetworkAndBroadcast: true\n").unwrap().len(), 256);
    // /31 and /32 have no network or broadcast address to skip.
    assert_eq!(ips("addresses: [198.18.1.0/31, 198.18.1.7/32]\n").unwrap(), ["198.18.1.0", "198.18.1.1", "198.18.1.7"]);
    // Named on its own or in a range: kept.
    assert_eq!(ips("addresses: [198.18.1.0/30, 198.18.1.3, 198.18.1.0-198.18.1.0]\n").unwrap(), ["198.18.1.0", "198.18.1.1", "198.18.1.2", "198.18.1.3"]);
    let FieldError { path, message: msg } = ips("addresses: [198.18.1.0/30]\nexcludedIPs: [198.18.1.1, 198.18.1.2]\n").unwrap_err();
    assert_eq!(path, "spec.addresses");
    assert!(msg.contains("network/broadcast"), "{msg}");
}

/// IPv6 entries: the first address of a prefix (subnet-router anycast) is never
/// handed out, ranges and exclusions work as for IPv4, a /64 stays a range.
#[test]
fn ipv6_pools() {
    let ranges = |y: &str| {
        validate(&spec(y), 80).map(|v| v.addresses.ranges().map(|(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") }).collect::<Vec<_>>())
    };
    type Want<'a> = Result<&'a [&'a str], (&'a str, &'a str)>;
    let cases: &[(&str, Want)] = &[
        ("addresses: [2001:2::/64]\n", Ok(&["2001:2::1-2001:2::ffff:ffff:ffff:ffff"])),
        ("addresses: [2001:2::/64]\nincludeNetworkAndBroadcast: true\n", Ok(&["2001:2::1-2001:2::ffff:ffff:ffff:ffff"])),
        ("addresses: [2001:2::/64, \"2001:2::\"]\n", Ok(&["2001:2::1-2001:2::ffff:ffff:ffff:ffff"])),
        ("addresses: [2001:2::/127]\n", Ok(&["2001:2::-2001:2::1"])),
        ("addresses: [2001:2::10-2001:2::20]\nexcludedIPs: [2001:2::18/125, 2001:2::10]\n", Ok(&["2001:2::11-2001:2::17", "2001:2::20"])),
        ("addresses: [198.18.1.8/30, 2001:2::/126]\n", Ok(&["198.18.1.9-198.18.1.10", "2001:2::1-2001:2::3"])),
        ("addresses: [2001:2::/128]\n", Ok(&["2001:2::"])),
        ("addresses: [2001:2::/126]\nexcludedIPs: [2001:2::1-2001:2::3]\n", Err(("spec.addresses", "subnet-router anycast"))),
        ("addresses: [2001:2::1/64]\n", Err(("spec.addresses[0]", "has host bits set; did you mean 2001:2::/64?"))),
        ("addresses: [198.18.1.1-2001:2::1]\n", Err(("spec.addresses[0]", "mixes an IPv4 and an IPv6 address"))),
        ("addresses: [2001:2::/64]\nexcludedIPs: [2001:3::1]\n", Err(("spec.excludedIPs[0]", "2001:3::1 is not in this pool's addresses"))),
        ("addresses: [\"2001:2::g\"]\n", Err(("spec.addresses[0]", "is not an IPv4 or IPv6 address"))),
    ];
    for (y, want) in cases {
        match (ranges(y), want) {
            (Ok(got), Ok(w)) => assert_eq!(got, *w, "{y}"),
            (Err(FieldError { path, message }), Err((p, m))) => assert!(path == *p && message.contains(m), "{y}: {path}: {message}"),
            (got, _) => panic!("{y}: {got:?}"),
        }
    }
}

#[test]
fn bad_specs_name_the_field() {
    let cases = [
        ("addresses: [198.18.1.10, nonsense]\n", "spec.addresses[1]", "is not an IPv4 or IPv6 address, CIDR"),
        ("addresses: [198.18.1.10]\nexcludedIPs: [198.18.1.11]\n", "spec.excludedIPs[0]", "198.18.1.11 is not in this pool's addresses"),
        ("addresses: [198.18.1.10]\nexcludedIPs: [x]\n", "spec.excludedIPs[0]", "\"x\" is not an IPv4 or IPv6 address"),
        ("addresses: [198.18.1.10]\nexcludedIPs: [198.18.1.10]\n", "spec.addresses", "no address left"),
        ("addresses: [198.18.1.10]\ntableSize: 1000\n", "spec.tableSize", "table size 1000 is not a prime"),
        ("addresses: [198.18.1.10]\nhealthCheck: {type: tcp, rise: 0}\n", "spec.healthCheck.rise", "must be at least 1"),
        ("addresses: [198.18.1.10]\ngratuitousArp: {count: 3, interval: 100ms, refresh: 0s}\n", "spec.gratuitousArp.refresh", "at least 1s"),
        ("addresses: [198.18.1.10]\ngratuitousArp: {count: 0}\n", "spec.gratuitousArp.count", "from 1 to 100"),
        ("addresses: [198.18.1.10]\ninterfaces: [eth0, \"..\"]\n", "spec.interfaces[1]", "\"..\" is not an interface name"),
        ("addresses: [198.18.1.10]\ninterfaces: [eth0, ens3, eth0]\n", "spec.interfaces[2]", "\"eth0\" is already listed at spec.interfaces[0]"),
        // 8 characters, 16 bytes: within the schema's maxLength (characters), over the kernel's limit (bytes).
        ("addresses: [198.18.1.10]\ninterfaces: [éééééééé]\n", "spec.interfaces[0]", "1 to 15 bytes"),
        ("addresses: [198.18.1.10]\ninterfaces: [\"eth0:1\"]\n", "spec.interfaces[0]", "it contains ':'"),
        ("addresses: [198.18.1.10]\ndistribution: all\n", "spec.distribution", "`all` needs `announce: lo`"),
    ];
    for (y, path, msg) in cases {
        let FieldError { path: p, message: m } = validate(&spec(y), 80).unwrap_err();
        assert_eq!(p, path, "{y}");
        assert!(m.contains(msg), "{y}: {m}");
    }
}

/// The schema's bounds are the agent's: every bound of the spec's schema
/// ([`spec_bounds`]), at its limits, is taken by validate(); just outside them,
/// refused naming the field (or not even read, past what the Rust type holds).
/// A bound only validate() knows of fails here for integers (the schema's range
/// is then wider than the agent's); one only the schema knows of fails too.
#[test]
fn validate_and_the_schema_agree_at_the_bounds() {
    use spec::{GARP_COUNT_MAX, GARP_COUNT_MIN, IFNAME_MAX, PROBE_PORT_MIN, RISE_FALL_MIN, VLAN_MAX, VLAN_MIN};
    let bound = |path: &str, of, min: Option<i64>, max: i64| SchemaBound { path: path.into(), of, min, max: Some(max) };
    let mut want = vec![
        bound("spec.gratuitousArp.count", BoundOf::Value, Some(GARP_COUNT_MIN.into()), GARP_COUNT_MAX.into()),
        bound("spec.healthCheck.fall", BoundOf::Value, Some(RISE_FALL_MIN.into()), u32::MAX.into()),
        bound("spec.healthCheck.port", BoundOf::Value, Some(PROBE_PORT_MIN.into()), u16::MAX.into()),
        bound("spec.healthCheck.rise", BoundOf::Value, Some(RISE_FALL_MIN.into()), u32::MAX.into()),
        bound("spec.interfaces", BoundOf::Items, None, MAX_POOL_INTERFACES as i64),
        bound("spec.interfaces[]", BoundOf::Length, Some(1), IFNAME_MAX as i64),
        bound("spec.tableSize", BoundOf::Value, Some(maglev::MIN_TABLE_SIZE.into()), maglev::MAX_TABLE_SIZE.into()),
        bound("spec.vlan", BoundOf::Value, Some(VLAN_MIN.into()), VLAN_MAX.into()),
    ];
    let mut got = spec_bounds();
    want.sort_by(|a, b| a.path.cmp(&b.path));
    got.sort_by(|a, b| a.path.cmp(&b.path));
    assert_eq!(got, want, "the schema's bounds: a new one is defined by a constant that validate() checks too");

    let check = |v: &serde_json::Value| -> Result<(), Option<FieldError>> {
        let s: VipPoolSpec = serde_json::from_value(v.clone()).map_err(|_| None)?;
        validate(&s, 80).map(drop).map_err(Some)
    };
    for b in spec_bounds() {
        let inside = [b.min, b.max].into_iter().flatten();
        for n in inside {
            let v = b.spec_with(n);
            assert_eq!(check(&v), Ok(()), "{}: {n} is within the schema's bounds: {v}", b.path);
        }
        let outside = [b.min.filter(|m| *m > 0).map(|m| m - 1), b.max.map(|m| m + 1)].into_iter().flatten();
        for n in outside {
            let v = b.spec_with(n);
            match check(&v) {
                Ok(()) => panic!("{}: validate() takes {n}, outside the schema's bounds: {v}", b.path),
                Err(Some(e)) => assert_eq!(e.path, b.field(), "{}: {n}: {e}", b.path),
                // Not a number of the Rust type (u32 past 4294967295): refused as it is read.
                Err(None) => {}
            }
        }
    }
    // What the schema cannot say: a table size within the range is still refused
    // unless it is a prime (by the agent, naming the field).
    let mid = SchemaBound { path: "spec.tableSize".into(), of: BoundOf::Value, min: None, max: None };
    let e = check(&mid.spec_with(1000)).unwrap_err().expect("read");
    assert_eq!((e.path.as_str(), e.message.as_str()), ("spec.tableSize", "table size 1000 is not a prime between 251 and 131071"));

    // Descriptions that state a bound state the constant's.
    let v = serde_json::to_value(crd()).unwrap();
    let props = &v["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
    for (d, says) in [
        (&props["tableSize"], format!("a prime from {} to {}", maglev::MIN_TABLE_SIZE, maglev::MAX_TABLE_SIZE)),
        (&props["gratuitousArp"]["properties"]["count"], format!("({GARP_COUNT_MIN} to {GARP_COUNT_MAX})")),
        (&props["vlan"], format!("({VLAN_MIN} to {VLAN_MAX})")),
        (&props["interfaces"], format!("1 to {IFNAME_MAX} bytes")),
    ] {
        let d = d["description"].as_str().unwrap_or_default();
        assert!(d.contains(&says), "{d:?} does not say {says:?}");
    }
}

/// deploy/crd.yaml is what `vip-agent crd` prints: regenerate it with
/// `cargo run -p vip-agent -- crd > deploy/crd.yaml` when the types change.
#[test]
fn committed_crd_matches_the_types() {
    let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/crd.yaml")).unwrap();
    assert!(committed == crd_yaml(), "deploy/crd.yaml drifted from the VipPool types; regenerate it with `cargo run -p vip-agent -- crd > deploy/crd.yaml`");
}

/// The server warns about formats it does not know (`unrecognized format "uint32"`),
/// descriptions are one line per paragraph, and the CRD describes itself.
#[test]
fn crd_schema_uses_known_formats_and_reflowed_descriptions() {
    fn walk(v: &serde_json::Value, path: &str, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(f) = m.get("format").and_then(|f| f.as_str()) {
                    if !["int32", "int64", "float", "double", "byte", "date", "date-time", "duration", "password"].contains(&f) {
                        out.push(format!("{path}: format {f}"));
                    }
                }
                if let Some(d) = m.get("description").and_then(|d| d.as_str()) {
                    for para in d.split("\n\n") {
                        if para.lines().skip(1).any(|l| !l.starts_with("- ") && !l.starts_with("* ")) {
                            out.push(format!("{path}: description broken mid-paragraph: {d:?}"));
                        }
                    }
                }
                m.iter().for_each(|(k, v)| walk(v, &format!("{path}.{k}"), out));
            }
            serde_json::Value::Array(a) => a.iter().enumerate().for_each(|(i, v)| walk(v, &format!("{path}[{i}]"), out)),
            _ => {}
        }
    }
    let v = serde_json::to_value(crd()).unwrap();
    let schema = &v["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let mut bad = Vec::new();
    walk(schema, "", &mut bad);
    assert!(bad.is_empty(), "{bad:#?}");
    let d = schema["description"].as_str().unwrap();
    assert!(d.starts_with("A pool of IPv4 and IPv6 addresses") && !d.contains("Auto-generated"), "{d}");
    let table = &schema["properties"]["spec"]["properties"]["tableSize"];
    assert_eq!(
        (table["format"].as_str(), table["minimum"].as_f64(), table["maximum"].as_f64()),
        (Some("int64"), Some(maglev::MIN_TABLE_SIZE.into()), Some(maglev::MAX_TABLE_SIZE.into()))
    );
    let addresses = schema["properties"]["spec"]["properties"]["addresses"]["description"].as_str().unwrap();
    assert!(
        addresses.starts_with(
            "IPv4 and IPv6 addresses, CIDRs (every address of the block) and inclusive ranges (`198.18.1.10-198.18.1.20`, `2001:2::10-2001:2::ff`)."
        ),
        "{addresses}"
    );
    let ifaces = &schema["properties"]["spec"]["properties"]["interfaces"];
    let item = &ifaces["items"];
    assert_eq!(
        (ifaces["maxItems"].as_u64(), item["minLength"].as_u64(), item["maxLength"].as_u64(), item["pattern"].as_str()),
        (Some(16), Some(1), Some(spec::IFNAME_MAX as u64), Some("^[^/:[:space:]]+$")),
        "{ifaces}"
    );
    assert_eq!(reflow("a\nb\n\nlist:\n- one\n  more\n- two"), "a b\n\nlist:\n- one more\n- two");
}

/// Names are DNS-1123 subdomains (what the API server takes for a custom
/// resource), one per address.
#[test]
fn vip_status_names_are_valid_and_unique() {
    let cases = [
        ("198.18.1.10", "198-18-1-10"),
        ("0.0.0.0", "0-0-0-0"),
        ("2001:2::10", "2001-2--10"),
        ("2001:2::", "2001-2--0"),
        ("::1", "0--1"),
        ("::", "0--0"),
        ("2001:db8:0:0:1:0:0:1", "2001-db8--1-0-0-1"),
        ("2001:2:3:4:5:6:7:8", "2001-2-3-4-5-6-7-8"),
        ("2001:2::ABCD", "2001-2--abcd"),
        ("::ffff:198.18.1.1", "0--ffff-198-18-1-1"),
    ];
    for (a, want) in cases {
        assert_eq!(vip_status_name(a.parse().unwrap()), want, "{a}");
    }
    let mut seen = std::collections::BTreeMap::new();
    let v4 = (0..=255u8).flat_map(|b| [IpAddr::from([198, 18, b, 1]), IpAddr::from([198, 19, 1, b]), IpAddr::from([b, 0, 0, b])]);
    let v6 = (0..=0xffu16).flat_map(|g| {
        [
            IpAddr::from([0x2001, 2, 0, 0, 0, 0, 0, g]),
            IpAddr::from([g, 0, 0, 0, 0, 0, 0, 0]),
            IpAddr::from([0, 0, 0, 0, 0, 0, 0, g]),
            IpAddr::from([0x2001, g, 0, 0, 1, 0, 0, 1]),
            IpAddr::from([0, g, 0, 0, 0, 0, g, 0]),
            IpAddr::from([0, 0, 0, 0, 0, 0xffff, 0xc612, g]),
        ]
    });
    for a in v4.chain(v6) {
        let n = vip_status_name(a);
        assert!(n.len() <= 253 && n.split('.').all(dns1123_label), "{a}: {n:?} is not a DNS-1123 subdomain");
        if let Some(b) = seen.insert(n.clone(), a) {
            assert_eq!(a, b, "{a} and {b} both named {n}");
        }
    }
}

/// A DNS-1123 label: 1 to 63 of `[a-z0-9-]`, starting and ending alphanumeric.
fn dns1123_label(l: &str) -> bool {
    let ok = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !l.is_empty() && l.len() <= 63 && l.starts_with(ok) && l.ends_with(ok) && l.chars().all(|c| ok(c) || c == '-')
}

/// Every status field is nullable or a list, so that a new holder's apply (all
/// fields named, null when unknown) replaces the previous holder's values; the
/// columns are those the docs describe.
#[test]
fn vip_status_crd_columns_and_nullable_status() {
    let v = serde_json::to_value(vip_status_crd()).unwrap();
    let version = &v["spec"]["versions"][0];
    let cols: Vec<(&str, &str)> =
        version["additionalPrinterColumns"].as_array().unwrap().iter().map(|c| (c["name"].as_str().unwrap(), c["jsonPath"].as_str().unwrap())).collect();
    assert_eq!(
        cols,
        [
            ("VIP", ".spec.address"),
            ("Holder", ".status.holder"),
            ("Interface", ".status.interface"),
            ("VLAN", ".status.vlan"),
            ("Since", ".status.heldSince"),
            ("Last GARP", ".status.lastGratuitousArp"),
            ("Backends", ".status.backends")
        ]
    );
    assert_eq!((v["spec"]["scope"].as_str(), v["spec"]["names"]["plural"].as_str()), (Some("Cluster"), Some("vipstatuses")));
    let status = &version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"];
    for (field, schema) in status.as_object().unwrap() {
        assert!(schema["nullable"] == true || schema["type"] == "array", "status.{field} is neither nullable nor a list: {schema}");
    }
    let full = serde_json::to_value(VipState::default()).unwrap();
    assert_eq!(full.as_object().unwrap().len(), status.as_object().unwrap().len(), "every field is serialized, null included: {full}");
    assert_eq!((status["vlan"]["minimum"].as_f64(), status["vlan"]["maximum"].as_f64()), (Some(1.0), Some(4094.0)));
}

#[test]
fn crd_has_status_subresource_and_conditions() {
    let y = crd_yaml();
    for want in [
        "name: vippools.vip.dev",
        "scope: Cluster",
        "status: {}",
        "conditions:",
        "excludedIPs:",
        "autoAssign:",
        "includeNetworkAndBroadcast:",
        "nodeSelector:",
        "tolerations:",
        "interfaces:",
    ] {
        assert!(y.contains(want), "CRD lacks {want:?}:\n{y}");
    }
}
