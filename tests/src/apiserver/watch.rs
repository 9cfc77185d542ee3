//! Watch streams: one JSON event per line, replayed from the history, then live.

use super::select::Filter;
use super::store::{Event, EventType, Msg};
use super::{ApiError, Shared};
use axum::body::{Body, Bytes};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast::{self, error::RecvError};
use tokio::time::{Instant, Interval};

/// The query parameters of a watch that matter here.
pub(crate) struct WatchQuery {
    pub resource_version: Option<String>,
    pub timeout: Duration,
    pub bookmarks: bool,
    pub send_initial_events: bool,
}

struct Stream {
    pending: VecDeque<Bytes>,
    rx: broadcast::Receiver<Msg>,
    res: usize,
    filter: Filter,
    /// The RV this stream has seen every event up to: what a bookmark may report.
    seen: u64,
    bookmarks: Option<Interval>,
    deadline: Instant,
    bookmark_object: Value,
    done: bool,
}

fn line(ty: &str, object: &Value) -> Bytes {
    let mut v = serde_json::to_vec(&json!({ "type": ty, "object": object })).expect("serializable");
    v.push(b'\n');
    v.into()
}

impl Stream {
    /// The event as this watch's filter sees it: a MODIFIED that moves an object
    /// into or out of the selection is an ADDED or a DELETED.
    fn push(&mut self, ev: &Event) {
        if ev.res != self.res {
            return;
        }
        let now = self.filter.matches(&ev.object);
        let before = ev.old.as_ref().is_some_and(|o| self.filter.matches(o));
        let ty = match (ev.ty, before, now) {
            (EventType::Added, _, true) | (EventType::Modified, false, true) => "ADDED",
            (EventType::Modified, true, true) => "MODIFIED",
            (EventType::Deleted, _, true) | (EventType::Modified, true, false) => "DELETED",
            _ => return,
        };
        self.pending.push_back(line(ty, &ev.object));
    }

    fn bookmark(&mut self, annotations: Option<Value>) {
        let mut obj = self.bookmark_object.clone();
        obj["metadata"] = json!({ "resourceVersion": self.seen.to_string() });
        if let Some(a) = annotations {
            obj["metadata"]["annotations"] = a;
        }
        self.pending.push_back(line("BOOKMARK", &obj));
    }

    async fn next(&mut self) -> Option<Bytes> {
        loop {
            if let Some(b) = self.pending.pop_front() {
                return Some(b);
            }
            if self.done {
                return None;
            }
            let tick = async {
                match &mut self.bookmarks {
                    Some(i) => i.tick().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tokio::time::sleep_until(self.deadline) => self.done = true,
                msg = self.rx.recv() => match msg {
                    Ok(Msg::Event(ev)) => {
                        self.seen = ev.rv;
                        self.push(&ev);
                    }
                    Ok(Msg::Close) | Err(RecvError::Closed) => self.done = true,
                    // Too slow a reader: like the real watch cache, drop it; it must re-list.
                    Err(RecvError::Lagged(_)) => {
                        let e = ApiError::expired(format!("watch of a slow client dropped at {}", self.seen));
                        self.pending.push_back(line("ERROR", &e.to_json()));
                        self.done = true;
                    }
                },
                _ = tick => self.bookmark(None),
            }
        }
    }
}

/// The response body of a watch request; an RV older than the history gives the
/// 410 ERROR event (with HTTP 200, as the real server does).
pub(crate) fn start(shared: &Arc<Shared>, res: usize, filter: Filter, q: WatchQuery) -> Result<Body, ApiError> {
    let store = shared.store.lock().expect("store lock");
    let spec = store.resources[res];
    // Subscribing under the lock: nothing committed between the replay and the live events is lost.
    let rx = store.tx.subscribe();
    let rv = match q.resource_version.as_deref() {
        None | Some("") | Some("0") => None,
        Some(s) => Some(s.parse::<u64>().map_err(|_| ApiError::new(400, "BadRequest", format!("invalid resourceVersion: {s:?}")))?),
    };
    let period = shared.bookmark_interval;
    let mut stream = Stream {
        pending: VecDeque::new(),
        rx,
        res,
        filter,
        seen: store.rv,
        bookmarks: q.bookmarks.then(|| tokio::time::interval_at(Instant::now() + period, period)),
        deadline: Instant::now() + q.timeout,
        bookmark_object: json!({ "apiVersion": spec.api_version(), "kind": spec.kind }),
        done: false,
    };
    match rv.filter(|_| !q.send_initial_events) {
        // No RV (or "0", "any"), or a streaming list: the current state as ADDED events first.
        None => {
            for obj in store.list(res, |o| stream.filter.matches(o)) {
                stream.pending.push_back(line("ADDED", &obj));
            }
            if q.send_initial_events {
                stream.bookmark(Some(json!({ "k8s.io/initial-events-end": "true" })));
            }
        }
        Some(rv) => match store.since(rv) {
            Some(events) => {
                let events: Vec<_> = events.cloned().collect();
                events.iter().for_each(|e| stream.push(e));
            }
            None => {
                let e = ApiError::expired(format!("too old resource version: {rv} ({})", store.compacted + 1));
                stream.pending.push_back(line("ERROR", &e.to_json()));
                stream.done = true;
            }
        },
    }
    drop(store);
    let body = futures_util::stream::unfold(stream, |mut s| async move { s.next().await.map(|b| (Ok::<_, Infallible>(b), s)) });
    Ok(Body::from_stream(body))
}
