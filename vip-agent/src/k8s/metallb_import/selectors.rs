//! MetalLB's lists of label selectors, which it ORs, as the one selector a VipPool
//! takes where that can be done.
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

/// A selector with empty parts as absent, so that equal selectors compare equal.
pub(super) fn normalized(mut s: LabelSelector) -> LabelSelector {
    s.match_labels = s.match_labels.filter(|m| !m.is_empty());
    s.match_expressions = s.match_expressions.filter(|e| !e.is_empty());
    s
}

pub(super) fn matches_everything(s: &LabelSelector) -> bool {
    s.match_labels.is_none() && s.match_expressions.is_none()
}

/// `key In (values)` when that is all the selector says.
fn single_key_in(s: &LabelSelector) -> Option<(String, Vec<String>)> {
    match (&s.match_labels, s.match_expressions.as_deref()) {
        (Some(m), None) if m.len() == 1 => m.iter().next().map(|(k, v)| (k.clone(), vec![v.clone()])),
        (None, Some([e])) if e.operator == "In" => Some((e.key.clone(), e.values.clone().unwrap_or_default())),
        _ => None,
    }
}

/// The selector as plain labels (matchLabels, and `In` with one value), if it is that.
pub(super) fn as_labels(s: &LabelSelector) -> Option<BTreeMap<String, String>> {
    let mut out = s.match_labels.clone().unwrap_or_default();
    for e in s.match_expressions.iter().flatten() {
        match e.values.as_deref() {
            Some([v]) if e.operator == "In" && out.get(&e.key).is_none_or(|x| x == v) => {
                out.insert(e.key.clone(), v.clone());
            }
            _ => return None,
        }
    }
    Some(out)
}

pub(super) fn describe(s: &LabelSelector) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// One selector for what MetalLB ORs: all when one alternative selects all,
/// alternatives on one key merged into `key In (...)`, else the first one.
pub(super) struct OneOf {
    pub(super) selector: Option<LabelSelector>,
    /// The alternative kept when others were left out, and those left out.
    pub(super) kept: Option<String>,
    pub(super) dropped: Vec<String>,
}

pub(super) fn one_of(alternatives: &[(String, LabelSelector)]) -> OneOf {
    let mut alts: Vec<&(String, LabelSelector)> = Vec::new();
    for a in alternatives {
        if !alts.iter().any(|b| b.1 == a.1) {
            alts.push(a);
        }
    }
    let exact = |selector| OneOf { selector, kept: None, dropped: Vec::new() };
    match alts.as_slice() {
        [] => return exact(None),
        _ if alts.iter().any(|a| matches_everything(&a.1)) => return exact(None),
        [one] => return exact(Some(one.1.clone())),
        _ => {}
    }
    let keyed: Option<Vec<(String, Vec<String>)>> = alts.iter().map(|a| single_key_in(&a.1)).collect();
    if let Some(keyed) = keyed.filter(|k| k.iter().all(|(key, _)| *key == k[0].0)) {
        let mut values: Vec<String> = Vec::new();
        for v in keyed.iter().flat_map(|(_, v)| v) {
            if !values.contains(v) {
                values.push(v.clone());
            }
        }
        let req = LabelSelectorRequirement { key: keyed[0].0.clone(), operator: "In".into(), values: Some(values) };
        return exact(Some(LabelSelector { match_expressions: Some(vec![req]), match_labels: None }));
    }
    OneOf { selector: Some(alts[0].1.clone()), kept: Some(alts[0].0.clone()), dropped: alts[1..].iter().map(|a| a.0.clone()).collect() }
}
