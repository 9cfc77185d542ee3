//! Objects, the global resourceVersion and the bounded event history.

use super::{crd, nodes, services, ApiError, ResourceSpec};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use tokio::sync::broadcast;

/// What a watch stream receives: every committed change of every resource, in
/// resourceVersion order, or the order to end.
#[derive(Clone, Debug)]
pub(crate) enum Msg {
    Event(Arc<Event>),
    Close,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EventType {
    Added,
    Modified,
    Deleted,
}

#[derive(Debug)]
pub(crate) struct Event {
    pub rv: u64,
    pub res: usize,
    pub ty: EventType,
    /// The object after the change (for DELETED: its last state, at the deletion's RV).
    pub object: Value,
    /// The object before a MODIFIED, so that selector watches can turn it into ADDED/DELETED.
    pub old: Option<Value>,
}

/// Which part of an object a write may change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    /// The main resource: `.status` is kept from the stored object when the
    /// resource has a status subresource.
    Main,
    /// The `/status` subresource: only `.status` is taken from the body.
    Status,
    /// The in-process test hook: the whole body.
    Whole,
}

type Key = (usize, String, String);

/// A stored object and the warnings the write earned (pruned unknown fields).
pub(crate) struct Written {
    pub object: Value,
    pub warnings: Vec<String>,
}

pub(crate) struct Store {
    pub resources: Vec<ResourceSpec>,
    pub rv: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Arc<Event>>,
    history_limit: usize,
    /// Events with `rv <= compacted` are gone: a watch from such an RV gets 410.
    pub compacted: u64,
    pub tx: broadcast::Sender<Msg>,
    uids: u64,
    /// The structural schema of each resource a CRD in deploy/ defines.
    schemas: Vec<Option<crd::Schema>>,
    taint_new_nodes: bool,
    stack: services::Stack,
    /// Who owns each top-level field of an object's `.status` (server-side apply).
    status_owners: BTreeMap<Key, BTreeMap<String, BTreeSet<String>>>,
}

/// The owner of status fields written by a merge patch or PUT (the real server
/// names the client's field manager; the stand-in keeps no managedFields).
const UPDATE_MANAGER: &str = "(update)";

fn meta_str<'a>(obj: &'a Value, field: &str) -> &'a str {
    obj["metadata"][field].as_str().unwrap_or("")
}

fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj["metadata"].is_object() {
        obj["metadata"] = json!({});
    }
    obj["metadata"].as_object_mut().expect("metadata is an object")
}

/// What generation counts: everything but metadata and status.
fn spec_of(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
    }
    o
}

impl Store {
    pub fn new(resources: Vec<ResourceSpec>, history_limit: usize, taint_new_nodes: bool, stack: services::Stack) -> Self {
        // A watcher that falls this far behind gets 410 (as with the real watch cache).
        let (tx, _) = broadcast::channel(history_limit.max(16));
        let schemas = resources.iter().map(|r| if r.group.is_empty() { None } else { crd::Schema::find(r.group, r.version, r.plural) }).collect();
        Store {
            resources,
            rv: 1,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            history_limit,
            compacted: 0,
            tx,
            uids: 0,
            schemas,
            taint_new_nodes,
            stack,
            status_owners: BTreeMap::new(),
        }
    }

    /// What other Services (all namespaces, not `key`) hold.
    fn services_used(&self, res: usize, key: &Key) -> services::Used {
        services::Used::of(self.objects.range((res, String::new(), String::new())..).take_while(|(k, _)| k.0 == res).filter(|(k, _)| *k != key).map(|(_, v)| v))
    }

    /// The registry's own work on an object about to be stored (and admission's, for
    /// a client's create): defaults, allocation, validation. `old` on update.
    fn prepare(&self, res: usize, key: &Key, old: Option<&Value>, obj: &mut Value, part: Part) -> Result<Vec<String>, ApiError> {
        let spec = &self.resources[res];
        let name = key.2.as_str();
        if *spec == ResourceSpec::SERVICES {
            // A status write allocates nothing: no need to look at every Service.
            let used = if part == Part::Status { services::Used::default() } else { self.services_used(res, key) };
            match old {
                None => services::prepare_create(self.stack, name, obj, &used)?,
                Some(old) => services::prepare_update(self.stack, old, obj, part, &used)?,
            }
        }
        if *spec == ResourceSpec::NODES && old.is_none() && part == Part::Main && self.taint_new_nodes {
            nodes::taint_not_ready(obj);
        }
        if *spec == ResourceSpec::SECRETS {
            secret_string_data(obj);
        }
        match &self.schemas[res] {
            Some(schema) => {
                let scope = if part == Part::Status { crd::Scope::Status } else { crd::Scope::Object };
                crd::prepare(schema, obj, scope).map_err(|causes| ApiError::invalid(spec, name, causes))
            }
            None => Ok(Vec::new()),
        }
    }

    fn key(res: usize, ns: Option<&str>, name: &str) -> Key {
        (res, ns.unwrap_or("").to_owned(), name.to_owned())
    }

    pub fn get(&self, res: usize, ns: Option<&str>, name: &str) -> Result<Value, ApiError> {
        self.objects.get(&Self::key(res, ns, name)).cloned().ok_or_else(|| ApiError::not_found(&self.resources[res], name))
    }

    /// Objects of `res` (all namespaces when `ns` is None) that `keep` accepts, by namespace and name.
    pub fn list(&self, res: usize, keep: impl Fn(&Value) -> bool) -> Vec<Value> {
        let lo = (res, String::new(), String::new());
        self.objects.range(lo..).take_while(|((r, _, _), _)| *r == res).map(|(_, v)| v).filter(|v| keep(v)).cloned().collect()
    }

    /// Events of `res` after `rv` still in the history; None when some were compacted away.
    pub fn since(&self, rv: u64) -> Option<impl Iterator<Item = &Arc<Event>>> {
        (rv >= self.compacted).then(|| self.history.iter().filter(move |e| e.rv > rv))
    }

    /// Forgets the history and ends every watch. The RV moves on by one (a no-op
    /// write) so that every RV a client holds is now older than the history.
    pub fn compact(&mut self) {
        self.rv += 1;
        self.compacted = self.rv;
        self.history.clear();
        let _ = self.tx.send(Msg::Close);
    }

    fn commit(&mut self, res: usize, ty: EventType, mut object: Value, old: Option<Value>) -> Value {
        self.rv += 1;
        meta_mut(&mut object).insert("resourceVersion".into(), self.rv.to_string().into());
        let key = Self::key(res, Some(meta_str(&object, "namespace")), meta_str(&object, "name"));
        if ty == EventType::Deleted {
            self.objects.remove(&key);
        } else {
            self.objects.insert(key, object.clone());
        }
        let ev = Arc::new(Event { rv: self.rv, res, ty, object: object.clone(), old });
        if self.history.len() == self.history_limit {
            if let Some(gone) = self.history.pop_front() {
                self.compacted = gone.rv;
            }
        }
        self.history.push_back(ev.clone());
        let _ = self.tx.send(Msg::Event(ev));
        object
    }

    /// Checks the body's identity against the request path and sets what the
    /// server owns (apiVersion, kind, namespace).
    fn normalize(&self, res: usize, ns: Option<&str>, name: Option<&str>, body: &mut Value) -> Result<(), ApiError> {
        let spec = &self.resources[res];
        if !body.is_object() {
            return Err(ApiError::new(400, "BadRequest", "the body is not a JSON object".into()));
        }
        body["apiVersion"] = spec.api_version().into();
        body["kind"] = spec.kind.into();
        let meta = meta_mut(body);
        match (meta.get("namespace").and_then(Value::as_str), ns) {
            (Some(b), Some(p)) if !b.is_empty() && b != p => {
                return Err(ApiError::new(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request".into()))
            }
            (_, Some(p)) => {
                meta.insert("namespace".into(), p.into());
            }
            (_, None) => {
                meta.remove("namespace");
            }
        }
        if let Some(name) = name {
            match meta.get("name").and_then(Value::as_str) {
                Some(b) if b != name => {
                    return Err(ApiError::new(400, "BadRequest", format!("the name of the object ({b}) does not match the name on the URL ({name})")))
                }
                _ => {
                    meta.insert("name".into(), name.into());
                }
            }
        }
        Ok(())
    }

    pub fn create(&mut self, res: usize, ns: Option<&str>, mut body: Value, part: Part) -> Result<Written, ApiError> {
        self.normalize(res, ns, None, &mut body)?;
        let spec = self.resources[res];
        // Like the real registry strategies: status is not set through the main
        // resource, except on a Node (a kubelet registers it with its status).
        if part != Part::Whole && spec.status && spec != ResourceSpec::NODES {
            body.as_object_mut().expect("object").remove("status");
        }
        self.uids += 1;
        let uid = format!("7669702d-0000-4000-8000-{:012x}", self.uids);
        let meta = meta_mut(&mut body);
        let mut name = meta.get("name").and_then(Value::as_str).unwrap_or("").to_owned();
        if name.is_empty() {
            let prefix = meta.get("generateName").and_then(Value::as_str).unwrap_or("");
            if prefix.is_empty() {
                return Err(ApiError::new(422, "Invalid", "metadata.name: Required value: name or generateName is required".into()));
            }
            name = format!("{prefix}{:05x}", self.uids & 0xfffff);
        }
        meta.insert("name".into(), name.clone().into());
        meta.insert("uid".into(), uid.into());
        meta.insert("creationTimestamp".into(), rfc3339_now().into());
        meta.insert("generation".into(), 1.into());
        meta.remove("deletionTimestamp");
        meta.remove("managedFields");
        let key = Self::key(res, ns, &name);
        let warnings = self.prepare(res, &key, None, &mut body, part)?;
        if self.objects.contains_key(&key) {
            return Err(ApiError::new(409, "AlreadyExists", format!("{} \"{name}\" already exists", spec.qualified())).details(&spec, &name));
        }
        self.status_owners.remove(&key);
        Ok(Written { object: self.commit(res, EventType::Added, body, None), warnings })
    }

    pub fn update(&mut self, res: usize, ns: Option<&str>, name: &str, mut body: Value, part: Part) -> Result<Written, ApiError> {
        self.normalize(res, ns, Some(name), &mut body)?;
        let spec = self.resources[res];
        let old = self.get(res, ns, name)?;
        let precondition = |field: &str| {
            let want = meta_str(&body, field);
            if want.is_empty() || want == meta_str(&old, field) {
                Ok(())
            } else {
                Err(ApiError::conflict(&spec, name))
            }
        };
        precondition("resourceVersion")?;
        precondition("uid")?;
        let mut new = match part {
            Part::Status => {
                let mut n = old.clone();
                match body.get("status") {
                    Some(s) => n["status"] = s.clone(),
                    None => {
                        n.as_object_mut().expect("object").remove("status");
                    }
                }
                n
            }
            Part::Main if spec.status => {
                let b = body.as_object_mut().expect("object");
                match old.get("status") {
                    Some(s) => b.insert("status".into(), s.clone()),
                    None => b.remove("status"),
                };
                body
            }
            Part::Main | Part::Whole => body,
        };
        let om = &old["metadata"];
        let meta = meta_mut(&mut new);
        for f in ["uid", "creationTimestamp", "generation", "resourceVersion"] {
            meta.insert(f.into(), om[f].clone());
        }
        meta.remove("managedFields");
        let warnings = self.prepare(res, &Self::key(res, ns, name), Some(&old), &mut new, part)?;
        if new == old {
            // A write that changes nothing is not a write: no new RV, no event.
            return Ok(Written { object: old, warnings });
        }
        if spec_of(&new) != spec_of(&old) {
            let g = old["metadata"]["generation"].as_i64().unwrap_or(0) + 1;
            meta_mut(&mut new).insert("generation".into(), g.into());
        }
        // Status fields this write changed are the updater's now, removed ones nobody's.
        let key = Self::key(res, ns, name);
        if let Some(owners) = self.status_owners.get_mut(&key) {
            let field = |o: &Value, f: &str| o["status"].get(f).cloned();
            let fields: BTreeSet<String> = owners.keys().cloned().chain(new["status"].as_object().into_iter().flat_map(|m| m.keys().cloned())).collect();
            for f in fields {
                match field(&new, &f) {
                    None => {
                        owners.remove(&f);
                    }
                    Some(v) if Some(&v) != field(&old, &f).as_ref() => {
                        owners.insert(f, BTreeSet::from([UPDATE_MANAGER.to_owned()]));
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(Written { object: self.commit(res, EventType::Modified, new, Some(old)), warnings })
    }

    /// A server-side apply of `body`'s `.status` by `manager` (see the module
    /// comment of `apiserver` for what is covered).
    pub fn apply_status(&mut self, res: usize, ns: Option<&str>, name: &str, manager: &str, force: bool, mut body: Value) -> Result<Written, ApiError> {
        self.normalize(res, ns, Some(name), &mut body)?;
        let key = Self::key(res, ns, name);
        let old = self.get(res, ns, name)?;
        let applied = body["status"].as_object().cloned().unwrap_or_default();
        let mut owners = self.status_owners.get(&key).cloned().unwrap_or_default();
        let mut status = old["status"].as_object().cloned().unwrap_or_default();
        let mut conflicts = Vec::new();
        for (f, v) in &applied {
            let others: Vec<&String> = owners.get(f).into_iter().flatten().filter(|m| *m != manager).collect();
            if !force && status.get(f) != Some(v) {
                conflicts.extend(others.into_iter().map(|m| (m.clone(), format!(".status.{f}"))));
            }
        }
        if !conflicts.is_empty() {
            let causes: Vec<Value> = conflicts
                .iter()
                .map(|(m, f)| json!({ "reason": "FieldManagerConflict", "message": format!("conflict with \"{m}\" with subresource \"status\""), "field": f }))
                .collect();
            let each: Vec<String> = conflicts.iter().map(|(m, f)| format!("conflict with \"{m}\" with subresource \"status\": {f}")).collect();
            let n = conflicts.len();
            let mut e = ApiError::new(409, "Conflict", format!("Apply failed with {n} conflict{}: {}", if n == 1 { "" } else { "s" }, each.join("\n")));
            e.details = Some(json!({ "causes": causes }));
            return Err(e);
        }
        // Fields this manager applied before and omits now: its ownership goes, and
        // the field with it when nobody else owns it.
        owners.retain(|f, ms| {
            if applied.contains_key(f) || !ms.remove(manager) {
                return true;
            }
            if ms.is_empty() {
                status.remove(f);
            }
            !ms.is_empty()
        });
        for (f, v) in applied {
            let ms = owners.entry(f.clone()).or_default();
            // A forced apply takes over what it changes; a value it leaves as it is
            // is shared with its other owners.
            if status.get(&f) != Some(&v) {
                ms.clear();
            }
            ms.insert(manager.to_owned());
            status.insert(f, v);
        }
        let mut new = old.clone();
        new["status"] = Value::Object(status);
        let w = self.update(res, ns, name, new, Part::Status)?;
        // The apply's ownership, not the update's (also when nothing changed).
        self.status_owners.insert(key, owners);
        Ok(w)
    }

    pub fn delete(&mut self, res: usize, ns: Option<&str>, name: &str, pre: &Value) -> Result<Value, ApiError> {
        let spec = self.resources[res];
        let old = self.get(res, ns, name)?;
        for f in ["resourceVersion", "uid"] {
            if let Some(want) = pre[f].as_str() {
                if want != meta_str(&old, f) {
                    return Err(ApiError::conflict(&spec, name));
                }
            }
        }
        self.status_owners.remove(&Self::key(res, ns, name));
        Ok(self.commit(res, EventType::Deleted, old, None))
    }
}

/// RFC 7386 JSON merge patch.
pub(crate) fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let t = target.as_object_mut().expect("object");
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

/// `2024-05-01T12:00:00Z`, the format of metav1.Time.
fn rfc3339_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// What the real server does with a Secret's `stringData`: each entry replaces the
/// `data` entry of its key, base64-encoded, and `stringData` itself is not stored.
fn secret_string_data(obj: &mut Value) {
    use base64::Engine as _;
    let Some(string_data) = obj.as_object_mut().and_then(|o| o.remove("stringData")) else { return };
    let Some(entries) = string_data.as_object() else { return };
    if !obj["data"].is_object() {
        obj["data"] = Value::Object(Default::default());
    }
    for (k, v) in entries {
        obj["data"][k] = base64::engine::general_purpose::STANDARD.encode(v.as_str().unwrap_or_default()).into();
    }
}
