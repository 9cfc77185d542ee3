//! Authentication and RBAC, as far as vip relies on them: the agent runs as the
//! deploy/10-rbac.yaml ServiceAccount, and everything that RBAC does not grant it
//! must be refused in CI as the real server refuses it.
//!
//! - Authentication: a bearer token from [`service_account_token`] is that
//!   ServiceAccount (`system:serviceaccount:NS:NAME`, in the groups
//!   `system:serviceaccounts`, `system:serviceaccounts:NS`, `system:authenticated`);
//!   any other token is a 401 `Unauthorized`. A request without credentials is the
//!   tests' admin: the stand-in has no client certificates, and its header-less
//!   client stands for the real server's `system:masters` certificate.
//! - Authorization: the Roles, ClusterRoles and their bindings of deploy/10-rbac.yaml,
//!   matched as the RBAC authorizer does (verbs, API groups, `resource/subresource`,
//!   `resourceNames`; a RoleBinding grants in its namespace, a ClusterRoleBinding
//!   everywhere); a list or watch with `fieldSelector=metadata.name=X` is authorized
//!   for the name X (the real server's request info does the same), so a
//!   `resourceNames` rule covers the agent's watch of its one Secret. Discovery is
//!   open to every authenticated user (the default `system:discovery` role), and so is
//!   `selfsubjectreviews` (`system:basic-user`).
//! - Refusals: 403 `Forbidden`, worded as kube-apiserver's
//!   `responsewriters.forbiddenMessage` words them (`secrets "x" is forbidden: User
//!   "..." cannot get resource "secrets" in API group "" in the namespace "vip-system"`).
//!   The codes were observed on kube-apiserver v1.36.2 (tests/tests/k8s_rbac.rs); the
//!   wording is the server's source, checked there against the real server where one
//!   is supplied.
//!
//! Not modelled: the default roles beyond discovery and self-review, aggregated
//! ClusterRoles, impersonation, the Node and Webhook authorizers.
use serde_json::{json, Value};

use super::{ApiError, ResourceSpec};

/// What one request asks for, as the authorizer sees it.
pub struct Attributes<'a> {
    pub verb: &'a str,
    pub spec: &'a ResourceSpec,
    /// The `status` subresource.
    pub status: bool,
    pub namespace: Option<&'a str>,
    pub name: Option<&'a str>,
}

impl Attributes<'_> {
    /// `services` or `services/status`, as rules and refusals name it.
    fn resource(&self) -> String {
        if self.status {
            format!("{}/status", self.spec.plural)
        } else {
            self.spec.plural.to_owned()
        }
    }
}

/// An authenticated user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum User {
    /// No credentials: the tests' admin (`system:masters`).
    Admin,
    ServiceAccount {
        namespace: String,
        name: String,
    },
}

const TOKEN_PREFIX: &str = "stand-in/serviceaccount/";

/// The bearer token that authenticates as ServiceAccount `namespace/name` (the
/// stand-in's counterpart of a TokenRequest token).
pub fn service_account_token(namespace: &str, name: &str) -> String {
    format!("{TOKEN_PREFIX}{namespace}/{name}")
}

impl User {
    /// The user of a request's `Authorization` header (none: the admin).
    pub fn authenticate(authorization: Option<&str>) -> Result<Self, ApiError> {
        let Some(auth) = authorization else { return Ok(User::Admin) };
        let unauthorized = || ApiError::new(401, "Unauthorized", "Unauthorized".into());
        let token = auth.strip_prefix("Bearer ").ok_or_else(unauthorized)?;
        let (namespace, name) = token.strip_prefix(TOKEN_PREFIX).and_then(|t| t.split_once('/')).ok_or_else(unauthorized)?;
        if namespace.is_empty() || name.is_empty() || name.contains('/') {
            return Err(unauthorized());
        }
        Ok(User::ServiceAccount { namespace: namespace.into(), name: name.into() })
    }

    pub fn username(&self) -> String {
        match self {
            User::Admin => "kubernetes-admin".into(),
            User::ServiceAccount { namespace, name } => format!("system:serviceaccount:{namespace}:{name}"),
        }
    }

    pub fn groups(&self) -> Vec<String> {
        match self {
            User::Admin => vec!["system:masters".into(), "system:authenticated".into()],
            User::ServiceAccount { namespace, .. } => {
                vec!["system:serviceaccounts".into(), format!("system:serviceaccounts:{namespace}"), "system:authenticated".into()]
            }
        }
    }

    /// What `selfsubjectreviews` answers.
    pub fn self_subject_review(&self) -> Value {
        json!({ "kind": "SelfSubjectReview", "apiVersion": "authentication.k8s.io/v1", "metadata": {},
                "status": { "userInfo": { "username": self.username(), "groups": self.groups() } } })
    }
}

/// One rule of a Role or ClusterRole.
#[derive(Clone, Debug)]
struct Rule {
    groups: Vec<String>,
    resources: Vec<String>,
    names: Vec<String>,
    verbs: Vec<String>,
}

impl Rule {
    fn matches(&self, a: &Attributes) -> bool {
        let any = |v: &[String], x: &str| v.iter().any(|s| s == "*" || s == x);
        let resource = a.resource();
        let resource_ok = self.resources.iter().any(|r| r == "*" || *r == resource || (a.status && r == "*/status"));
        let name_ok = self.names.is_empty() || a.name.is_some_and(|n| self.names.iter().any(|s| s == n));
        any(&self.verbs, a.verb) && any(&self.groups, a.spec.group) && resource_ok && name_ok
    }
}

/// A rule granted to a subject, in one namespace or (None) everywhere.
#[derive(Clone, Debug)]
struct Grant {
    subject: Subject,
    namespace: Option<String>,
    rule: Rule,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Subject {
    User(String),
    Group(String),
}

/// The RBAC objects of a set of manifests.
#[derive(Clone, Debug, Default)]
pub struct Rbac {
    grants: Vec<Grant>,
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().into_iter().flatten().filter_map(|s| s.as_str().map(str::to_owned)).collect()
}

impl Rbac {
    /// The Roles, ClusterRoles and bindings of deploy/10-rbac.yaml.
    pub fn deploy() -> Self {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/10-rbac.yaml");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let docs = crate::kubeapi::documents(&text).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
        Self::from_documents(&docs)
    }

    /// Panics on a binding whose role is not among `docs` (the real authorizer
    /// would grant nothing and say why; here it is a broken fixture).
    pub fn from_documents(docs: &[Value]) -> Self {
        let rules = |d: &Value| -> Vec<Rule> {
            d["rules"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| Rule {
                    groups: strings(&r["apiGroups"]),
                    resources: strings(&r["resources"]),
                    names: strings(&r["resourceNames"]),
                    verbs: strings(&r["verbs"]),
                })
                .collect()
        };
        let role = |kind: &str, name: &str, ns: Option<&str>| -> Vec<Rule> {
            let d = docs
                .iter()
                .find(|d| d["kind"] == kind && d["metadata"]["name"] == name && (kind == "ClusterRole" || d["metadata"]["namespace"].as_str() == ns))
                .unwrap_or_else(|| panic!("a binding names {kind} {name}, which the manifests do not have"));
            rules(d)
        };
        let mut grants = Vec::new();
        for d in docs {
            let (binding_ns, scope) = match d["kind"].as_str() {
                Some("RoleBinding") => (d["metadata"]["namespace"].as_str(), d["metadata"]["namespace"].as_str().map(str::to_owned)),
                Some("ClusterRoleBinding") => (None, None),
                _ => continue,
            };
            let kind = d["roleRef"]["kind"].as_str().unwrap_or_default();
            let granted = role(kind, d["roleRef"]["name"].as_str().unwrap_or_default(), binding_ns);
            for s in d["subjects"].as_array().into_iter().flatten() {
                let name = s["name"].as_str().unwrap_or_default();
                let subject = match s["kind"].as_str() {
                    Some("ServiceAccount") => {
                        Subject::User(format!("system:serviceaccount:{}:{name}", s["namespace"].as_str().or(binding_ns).unwrap_or_default()))
                    }
                    Some("User") => Subject::User(name.into()),
                    Some("Group") => Subject::Group(name.into()),
                    other => panic!("a binding subject of kind {other:?}"),
                };
                grants.extend(granted.iter().map(|rule| Grant { subject: subject.clone(), namespace: scope.clone(), rule: rule.clone() }));
            }
        }
        Rbac { grants }
    }

    /// Whether `user` may do `a`.
    pub fn allows(&self, user: &User, a: &Attributes) -> bool {
        if *user == User::Admin {
            return true;
        }
        let (name, groups) = (user.username(), user.groups());
        self.grants.iter().any(|g| {
            let who = match &g.subject {
                Subject::User(u) => *u == name,
                Subject::Group(grp) => groups.contains(grp),
            };
            let place = g.namespace.as_deref().is_none_or(|ns| a.namespace == Some(ns));
            who && place && g.rule.matches(a)
        })
    }
}

/// The 403 for `a`, worded as kube-apiserver words it.
pub fn forbidden(user: &User, a: &Attributes) -> ApiError {
    let (resource, group) = (a.resource(), a.spec.group);
    let scope = match a.namespace {
        Some(ns) => format!("in the namespace \"{ns}\""),
        None => "at the cluster scope".into(),
    };
    let why = format!("User \"{}\" cannot {} resource \"{resource}\" in API group \"{group}\" {scope}", user.username(), a.verb);
    let qualified = a.spec.qualified();
    let message = match a.name {
        Some(n) => format!("{qualified} \"{n}\" is forbidden: {why}"),
        None => format!("{qualified} is forbidden: {why}"),
    };
    let mut e = ApiError::new(403, "Forbidden", message);
    let mut details = json!({ "kind": a.spec.plural });
    if let Some(n) = a.name {
        details["name"] = n.into();
    }
    if !group.is_empty() {
        details["group"] = group.into();
    }
    e.details = Some(details);
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `resource` as `plural[.group][/status]`, e.g. `vippools.vip.dev/status`.
    fn attrs<'a>(verb: &'a str, resource: &str, namespace: Option<&'a str>, name: Option<&'a str>) -> Attributes<'a> {
        let (qualified, status) = match resource.strip_suffix("/status") {
            Some(r) => (r, true),
            None => (resource, false),
        };
        let spec = ResourceSpec::VIP.iter().find(|r| r.qualified() == qualified).unwrap_or_else(|| panic!("{qualified}"));
        Attributes { verb, spec, status, namespace, name }
    }

    #[test]
    fn the_deploy_rbac_grants_the_agent_what_it_lists_and_nothing_else() {
        let rbac = Rbac::deploy();
        let agent = User::authenticate(Some(&format!("Bearer {}", service_account_token("vip-system", "vip-agent")))).unwrap();
        let other = User::authenticate(Some(&format!("Bearer {}", service_account_token("vip-system", "someone")))).unwrap();
        let cases = [
            (attrs("watch", "vippools.vip.dev", None, None), true),
            (attrs("patch", "vippools.vip.dev", None, Some("p")), false),
            (attrs("patch", "vippools.vip.dev/status", None, Some("p")), true),
            (attrs("list", "services", None, None), true),
            (attrs("create", "services", Some("shop"), None), false),
            (attrs("update", "services/status", Some("shop"), Some("web")), true),
            (attrs("create", "events.events.k8s.io", Some("shop"), None), true),
            (attrs("create", "events", Some("shop"), None), false),
            (attrs("update", "leases.coordination.k8s.io", Some("vip-system"), Some("vip-controller")), true),
            (attrs("update", "leases.coordination.k8s.io", Some("default"), Some("vip-controller")), false),
            (attrs("get", "secrets", Some("vip-system"), Some("vip-heartbeat")), true),
            (attrs("watch", "secrets", Some("vip-system"), Some("vip-heartbeat")), true),
            (attrs("list", "secrets", Some("vip-system"), None), false),
            (attrs("get", "secrets", Some("vip-system"), Some("not-vips")), false),
            (attrs("delete", "secrets", Some("vip-system"), Some("vip-heartbeat")), false),
            (attrs("create", "secrets", Some("vip-system"), None), true),
            (attrs("get", "secrets", Some("default"), Some("vip-heartbeat")), false),
            (attrs("delete", "vipstatuses.vip.dev", None, Some("x")), true),
            (attrs("update", "vipstatuses.vip.dev/status", None, Some("x")), false),
        ];
        for (a, want) in &cases {
            assert_eq!(rbac.allows(&agent, a), *want, "{} {} status={} {:?}", a.verb, a.spec.qualified(), a.status, a.name);
            assert!(!rbac.allows(&other, a), "another ServiceAccount is granted nothing");
            assert!(rbac.allows(&User::Admin, a));
        }
    }

    #[test]
    fn tokens_other_than_the_stand_ins_are_unauthorized() {
        for bad in
            ["Bearer nope", "Basic abc", "Bearer stand-in/serviceaccount/ns", "Bearer stand-in/serviceaccount//x", "Bearer stand-in/serviceaccount/a/b/c"]
        {
            assert_eq!(User::authenticate(Some(bad)).unwrap_err().code, 401, "{bad}");
        }
        assert_eq!(User::authenticate(None).unwrap(), User::Admin);
    }

    #[test]
    fn refusals_are_worded_as_the_real_servers() {
        let sa = User::ServiceAccount { namespace: "vip-system".into(), name: "vip-agent".into() };
        let e = forbidden(&sa, &attrs("get", "secrets", Some("vip-system"), Some("not-vips")));
        assert_eq!(
            e.message,
            r#"secrets "not-vips" is forbidden: User "system:serviceaccount:vip-system:vip-agent" cannot get resource "secrets" in API group "" in the namespace "vip-system""#
        );
        let e = forbidden(&sa, &attrs("patch", "vippools.vip.dev", None, Some("p")));
        assert_eq!(
            e.message,
            r#"vippools.vip.dev "p" is forbidden: User "system:serviceaccount:vip-system:vip-agent" cannot patch resource "vippools" in API group "vip.dev" at the cluster scope"#
        );
        assert_eq!(e.to_json()["details"], json!({ "kind": "vippools", "name": "p", "group": "vip.dev" }));
    }
}
