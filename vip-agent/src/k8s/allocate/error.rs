//! Why a Service gets no address (an `AllocationFailed` Warning on it, retried on
//! the next change). Each says where the cause is: the annotation or field that
//! asks, the pool, the family.
use std::net::IpAddr;

use super::ANNOTATION_SHARING_KEY;
use crate::addrs::Family;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("spec.loadBalancerIP: {0:?} is not an IP address")]
    BadLoadBalancerIp(String),
    #[error("{annotation}: {part:?} is not an IP address")]
    NotAnAddress { annotation: &'static str, part: String },
    #[error("{annotation}: {raw:?} names more than one address of a family (one IPv4 and one IPv6 at most)")]
    TwoOfAFamily { annotation: &'static str, raw: String },
    #[error("{annotation} names no address")]
    NoAddress { annotation: &'static str },
    #[error("requested address {addr} is {}, not of the Service's families (spec.ipFamilies: {families})", Family::of(*addr))]
    NotOfFamilies { addr: IpAddr, families: String },
    #[error("{0} addresses are requested, but the Service is SingleStack (spec.ipFamilyPolicy): ask for one")]
    SingleStack(usize),
    #[error("RequireDualStack: the requested addresses name no {0} address")]
    RequestLacks(Family),
    #[error("requested address {0} is in no VipPool")]
    InNoPool(IpAddr),
    #[error("requested address {addr} is in VipPool {pool:?}, not in {wanted:?} ({annotation})")]
    InOtherPool { addr: IpAddr, pool: String, wanted: String, annotation: &'static str },
    #[error("requested address {addr} is in pool {pool:?}, whose selectors do not admit this Service")]
    NotAdmitted { addr: IpAddr, pool: String },
    #[error("requested address {0} is in use by another Service (share it with a common {ANNOTATION_SHARING_KEY} and distinct ports)")]
    InUse(IpAddr),
    /// `family`: the one asked for, where the Service names its families.
    #[error("no VipPool with autoAssign admits this Service and has {}", free(*family))]
    NoPoolAdmits { family: Option<Family> },
    #[error("no valid VipPool named {name:?} ({annotation})")]
    NoSuchPool { name: String, annotation: &'static str },
    #[error("VipPool {name:?} ({annotation}) does not admit this Service (its selectors)")]
    PoolRefuses { name: String, annotation: &'static str },
    #[error("VipPool {name:?} ({annotation}) has no {}", &free(*family)[2..])]
    PoolFull { name: String, annotation: &'static str, family: Option<Family> },
    /// A RequireDualStack Service is given both families or neither.
    #[error("RequireDualStack needs an address of each family ({families}), none allocated until both can be: {}", joined(causes))]
    NotBothFamilies { families: String, causes: Vec<AllocError> },
    #[error("no address family to allocate")]
    NoFamily,
}

/// "a free address", naming the family only where the Service asked for one.
fn free(family: Option<Family>) -> String {
    family.map_or_else(|| "a free address".into(), |f| format!("a free {f} address"))
}

fn joined(causes: &[AllocError]) -> String {
    causes.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}
