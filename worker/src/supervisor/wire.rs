//! The messages between a worker and its supervisor (docs/design.md#the-task-supervisor): one
//! message per `SOCK_SEQPACKET` packet, its fields separated by NUL bytes (no field of a
//! command line or an environment can hold one), a tag first. A start carries the task's
//! standard streams as `SCM_RIGHTS` descriptors, a `Started` reply the task's pidfd.
//!
//! Pure encoding and decoding: the sockets are [`super::link`]'s (the worker's side) and
//! [`super::run`]'s.

use std::ffi::CString;

/// What the worker asks of its supervisor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Start a task: its descriptors are stdin, stderr and (when `stdout`) stdout, in that
    /// order.
    Start(Start),
    /// Send `signal` to the process group of task `id`, if it has not been reaped yet (an
    /// unknown id is ignored: the task ended and its `Exited` is on its way).
    Signal {
        /// The task.
        id: u64,
        /// The signal's number.
        signal: i32,
    },
    /// How many tasks are registered (answered with a `Census` of the same id).
    Census {
        /// The request's id, echoed in the answer.
        id: u64,
    },
    /// Task `id`'s lease was renewed: its stop moves to `deadline` (an unknown id, or a task
    /// whose stop has begun, is left as it is).
    Deadline {
        /// The task.
        id: u64,
        /// Its new stop.
        deadline: Deadline,
    },
}

/// When the supervisor stops a task on its own, whatever the worker does (it may be frozen):
/// SIGTERM to its group at `term`, SIGKILL at `kill`, both in nanoseconds on `CLOCK_BOOTTIME`
/// (one clock for every process of the host, counting a suspend). The worker derives them from
/// the run's lease (docs/design.md#the-task-supervisor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    /// SIGTERM to the group from then on.
    pub term: u64,
    /// SIGKILL to the group from then on (the worker's kill grace after `term`).
    pub kill: u64,
}

/// A task to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start {
    /// The worker's name for the run, unique per link.
    pub id: u64,
    /// Whether a stdout descriptor comes with the message (else the task writes to the
    /// supervisor's own stdout, the worker's).
    pub stdout: bool,
    /// When the task is stopped unless a renewal moves it ([`Request::Deadline`]); `None` for
    /// a run without a lease (a handler called directly).
    pub deadline: Option<Deadline>,
    /// The command; a program without a `/` is looked for on the `PATH` of `env`.
    pub argv: Vec<CString>,
    /// The task's whole environment, `NAME=value` each.
    pub env: Vec<CString>,
}

/// What the supervisor tells the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// Task `id` runs as `pid`, the leader of its own process group (its pidfd comes along).
    Started {
        /// The task.
        id: u64,
        /// Its leader's pid (and process group id).
        pid: i32,
    },
    /// Task `id` could not be started (`errno`: `ENOENT` when the program does not exist);
    /// nothing of it runs and nothing is registered.
    Failed {
        /// The task.
        id: u64,
        /// Why, as the kernel said.
        errno: i32,
    },
    /// Task `id`'s leader ended with `status`, and its process group was killed after it.
    Exited {
        /// The task.
        id: u64,
        /// How its leader ended.
        status: Status,
    },
    /// The answer to a `Census`: how many tasks the supervisor holds.
    Census {
        /// The `Census` request's id.
        id: u64,
        /// Tasks held.
        tasks: usize,
    },
}

/// How a task's leader ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// It exited with this code.
    Code(i32),
    /// A signal of this number ended it.
    Signal(i32),
}

/// A message that is not one of the above (a bug on one side; the link is then torn down).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed supervisor message: {0}")]
pub struct Malformed(pub &'static str);

impl Request {
    /// The request as one datagram (fields NUL-separated).
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Request::Start(start) => {
                let mut fields: Vec<&[u8]> =
                    Vec::with_capacity(5 + start.argv.len() + start.env.len());
                let (id, argc) = (start.id.to_string(), start.argv.len().to_string());
                let deadline = start
                    .deadline
                    .map_or("-".to_owned(), |d| format!("{}/{}", d.term, d.kill));
                fields.extend([
                    b"start".as_slice(),
                    id.as_bytes(),
                    if start.stdout { b"1" } else { b"0" },
                    deadline.as_bytes(),
                    argc.as_bytes(),
                ]);
                fields.extend(start.argv.iter().map(|a| a.as_bytes()));
                fields.extend(start.env.iter().map(|e| e.as_bytes()));
                fields.join(&0)
            }
            Request::Signal { id, signal } => join(&[
                b"signal",
                id.to_string().as_bytes(),
                signal.to_string().as_bytes(),
            ]),
            Request::Census { id } => join(&[b"census", id.to_string().as_bytes()]),
            Request::Deadline { id, deadline } => join(&[
                b"deadline",
                id.to_string().as_bytes(),
                deadline.term.to_string().as_bytes(),
                deadline.kill.to_string().as_bytes(),
            ]),
        }
    }

    /// The message `bytes` hold ([`Self::encode`]'s), or why it is none.
    pub fn decode(bytes: &[u8]) -> Result<Self, Malformed> {
        let mut fields = bytes.split(|&b| b == 0);
        match fields.next() {
            Some(b"start") => {
                let id = number(fields.next())?;
                let stdout = match fields.next() {
                    Some(b"0") => false,
                    Some(b"1") => true,
                    _ => return Err(Malformed("stdout flag")),
                };
                let deadline = match fields.next() {
                    Some(b"-") => None,
                    Some(field) => {
                        let (term, kill) = std::str::from_utf8(field)
                            .ok()
                            .and_then(|f| f.split_once('/'))
                            .ok_or(Malformed("deadline"))?;
                        Some(Deadline {
                            term: number(Some(term.as_bytes()))?,
                            kill: number(Some(kill.as_bytes()))?,
                        })
                    }
                    None => return Err(Malformed("deadline")),
                };
                let argc: usize = number(fields.next())?;
                let rest: Vec<CString> = fields
                    .map(|f| CString::new(f).expect("split at NUL"))
                    .collect();
                if argc == 0 || argc > rest.len() {
                    return Err(Malformed("argument count"));
                }
                let mut argv = rest;
                let env = argv.split_off(argc);
                Ok(Request::Start(Start {
                    id,
                    stdout,
                    deadline,
                    argv,
                    env,
                }))
            }
            Some(b"signal") => Ok(Request::Signal {
                id: number(fields.next())?,
                signal: number(fields.next())?,
            }),
            Some(b"census") => Ok(Request::Census {
                id: number(fields.next())?,
            }),
            Some(b"deadline") => Ok(Request::Deadline {
                id: number(fields.next())?,
                deadline: Deadline {
                    term: number(fields.next())?,
                    kill: number(fields.next())?,
                },
            }),
            _ => Err(Malformed("unknown request")),
        }
    }
}

impl Reply {
    /// The reply as one datagram (fields NUL-separated).
    pub fn encode(&self) -> Vec<u8> {
        match *self {
            Reply::Started { id, pid } => join(&[
                b"started",
                id.to_string().as_bytes(),
                pid.to_string().as_bytes(),
            ]),
            Reply::Failed { id, errno } => join(&[
                b"failed",
                id.to_string().as_bytes(),
                errno.to_string().as_bytes(),
            ]),
            Reply::Exited { id, status } => {
                let (how, n) = match status {
                    Status::Code(c) => (b"code".as_slice(), c),
                    Status::Signal(s) => (b"signal".as_slice(), s),
                };
                join(&[
                    b"exited",
                    id.to_string().as_bytes(),
                    how,
                    n.to_string().as_bytes(),
                ])
            }
            Reply::Census { id, tasks } => join(&[
                b"census",
                id.to_string().as_bytes(),
                tasks.to_string().as_bytes(),
            ]),
        }
    }

    /// The message `bytes` hold ([`Self::encode`]'s), or why it is none.
    pub fn decode(bytes: &[u8]) -> Result<Self, Malformed> {
        let mut fields = bytes.split(|&b| b == 0);
        let tag = fields.next();
        let id = number(fields.next())?;
        let reply = match tag {
            Some(b"started") => Reply::Started {
                id,
                pid: number(fields.next())?,
            },
            Some(b"failed") => Reply::Failed {
                id,
                errno: number(fields.next())?,
            },
            Some(b"exited") => {
                let how = fields.next();
                let n = number(fields.next())?;
                let status = match how {
                    Some(b"code") => Status::Code(n),
                    Some(b"signal") => Status::Signal(n),
                    _ => return Err(Malformed("exit status")),
                };
                Reply::Exited { id, status }
            }
            Some(b"census") => Reply::Census {
                id,
                tasks: number(fields.next())?,
            },
            _ => return Err(Malformed("unknown reply")),
        };
        match fields.next() {
            None => Ok(reply),
            Some(_) => Err(Malformed("trailing field")),
        }
    }
}

fn join(fields: &[&[u8]]) -> Vec<u8> {
    fields.join(&0)
}

fn number<T: std::str::FromStr>(field: Option<&[u8]>) -> Result<T, Malformed> {
    field
        .and_then(|f| std::str::from_utf8(f).ok()?.parse().ok())
        .ok_or(Malformed("number"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(s: &str) -> CString {
        CString::new(s).unwrap()
    }

    #[test]
    fn every_message_reads_back_as_itself() {
        let start = Request::Start(Start {
            id: 7,
            stdout: true,
            deadline: Some(Deadline {
                term: 12_000_000_000,
                kill: 12_500_000_000,
            }),
            argv: vec![c("/bin/sh"), c("-c"), c("echo a=b; exit 3")],
            env: vec![c("PATH=/usr/bin"), c("EMPTY="), c("DRUMLINE_KEY=k:1")],
        });
        assert_eq!(Request::decode(&start.encode()), Ok(start));
        let no_env = Request::Start(Start {
            id: 1,
            stdout: false,
            deadline: None,
            argv: vec![c("true")],
            env: vec![],
        });
        assert_eq!(Request::decode(&no_env.encode()), Ok(no_env));
        for request in [
            Request::Signal {
                id: u64::MAX,
                signal: 15,
            },
            Request::Census { id: 9 },
            Request::Deadline {
                id: 9,
                deadline: Deadline {
                    term: 1,
                    kill: u64::MAX,
                },
            },
        ] {
            assert_eq!(Request::decode(&request.encode()), Ok(request));
        }
        for reply in [
            Reply::Started { id: 3, pid: 4242 },
            Reply::Failed { id: 3, errno: 2 },
            Reply::Exited {
                id: 3,
                status: Status::Code(0),
            },
            Reply::Exited {
                id: 3,
                status: Status::Signal(9),
            },
            Reply::Census { id: 4, tasks: 1000 },
        ] {
            assert_eq!(Reply::decode(&reply.encode()), Ok(reply));
        }
    }

    #[test]
    fn a_message_out_of_shape_is_refused() {
        for bad in [
            &b""[..],
            b"start",
            b"start\x001\x002\x00-\x001\x00true",
            b"start\x001\x000\x00-\x000",
            b"start\x001\x000\x005\x001\x00true",
            b"start\x001\x000\x00x/5\x001\x00true",
            b"signal\x00x\x009",
            b"deadline\x001\x005",
            b"launch\x001",
        ] {
            assert!(Request::decode(bad).is_err(), "{bad:?}");
        }
        for bad in [
            &b""[..],
            b"started\x001",
            b"exited\x001\x00lost\x001",
            b"failed\x001\x002\x003",
        ] {
            assert!(Reply::decode(bad).is_err(), "{bad:?}");
        }
    }
}
