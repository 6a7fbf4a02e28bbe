//! `after` chains (docs/design.md#job-dependencies): which job each job's instants come from
//! (its root: the first job up the chain with a schedule of its own), with unknown upstreams
//! and cycles refused. Pure.

use std::collections::HashMap;

/// Why a chain of `after`s does not resolve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// Job `job` follows `upstream`, which no job is called.
    #[error("no job named {upstream:?} (`after` names the job whose instances this one follows)")]
    Unknown {
        /// Index of the follower.
        job: usize,
        /// The name it gave.
        upstream: String,
    },
    /// The chain from `job` comes back to itself: `path` names it, first and last the same.
    #[error("a cycle: {}", .path.join(" → "))]
    Cycle {
        /// Index of a job on the cycle.
        job: usize,
        /// The cycle's jobs, from `job` back to `job`.
        path: Vec<String>,
    },
}

/// Per job, the index of its root: itself for a job with no `after`, else the root of its
/// upstream. `names[i]` and `upstreams[i]` are job `i`'s name and `after`.
pub fn roots(names: &[&str], upstreams: &[Option<&str>]) -> Result<Vec<usize>, ChainError> {
    let index: HashMap<&str, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut root: Vec<Option<usize>> = vec![None; names.len()];
    for start in 0..names.len() {
        // Walk up until a job whose root is known or that has no upstream.
        let mut path = vec![start];
        let found = loop {
            let at = *path.last().expect("never empty");
            if let Some(r) = root[at] {
                break r;
            }
            let Some(up) = upstreams[at] else {
                break at;
            };
            let up = *index.get(up).ok_or_else(|| ChainError::Unknown {
                job: at,
                upstream: up.to_owned(),
            })?;
            if let Some(pos) = path.iter().position(|p| *p == up) {
                let mut cycle: Vec<String> =
                    path[pos..].iter().map(|i| names[*i].to_owned()).collect();
                cycle.push(names[up].to_owned());
                return Err(ChainError::Cycle {
                    job: up,
                    path: cycle,
                });
            }
            path.push(up);
        };
        for p in path {
            root[p] = Some(found);
        }
    }
    Ok(root
        .into_iter()
        .map(|r| r.expect("every job walked"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_of_any_length_resolves_to_its_root() {
        let names = ["c", "a", "b", "d", "solo"];
        let ups = [Some("b"), None, Some("a"), Some("c"), None];
        assert_eq!(roots(&names, &ups).unwrap(), vec![1, 1, 1, 1, 4]);
        // A long chain, written backwards.
        let names: Vec<String> = (0..500).map(|i| format!("j{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let ups: Vec<Option<&str>> = (0..500).map(|i| (i < 499).then(|| refs[i + 1])).collect();
        assert!(roots(&refs, &ups).unwrap().iter().all(|r| *r == 499));
    }

    #[test]
    fn an_unknown_upstream_is_named() {
        let e = roots(&["a", "b"], &[None, Some("nope")]).unwrap_err();
        assert_eq!(
            e,
            ChainError::Unknown {
                job: 1,
                upstream: "nope".into()
            }
        );
    }

    #[test]
    fn cycles_are_refused_with_their_path() {
        let e = roots(&["a", "b", "c"], &[Some("c"), Some("a"), Some("b")]).unwrap_err();
        assert_eq!(e.to_string(), "a cycle: a → c → b → a");
        let e = roots(&["x"], &[Some("x")]).unwrap_err();
        assert_eq!(e.to_string(), "a cycle: x → x");
        // A job hanging off a cycle is refused too (the cycle is named).
        let e = roots(&["t", "p", "q"], &[Some("p"), Some("q"), Some("p")]).unwrap_err();
        assert_eq!(e.to_string(), "a cycle: p → q → p");
    }
}
