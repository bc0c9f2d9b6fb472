;;;; gallop.asd -- Gallop: an event-driven HTTP server core for SBCL and a
;;;; drop-in upgrade for Hunchentoot.
;;;;
;;;; Systems:
;;;;   gallop/core   epoll event loop, elastic worker pool, connection streams.
;;;;                 Needs nothing but SBCL and its contribs.
;;;;   gallop/native the native app API (Clack convention), on the core alone.
;;;;   gallop        the Hunchentoot layer: GALLOP:ACCEPTOR, GALLOP:EASY-ACCEPTOR,
;;;;                 the SSL variants and GALLOP:TASKMASTER.
;;;;   gallop/tests  FiveAM tests that talk to real servers over real sockets
;;;;                 (`make test`: deterministic, no load).
;;;;   gallop/stress load, CPU-hog, 10,000-connection and pool-ceiling tests
;;;;                 (`make test-stress`).

(defsystem "gallop/core"
  :description "Gallop's core: epoll connections, an elastic worker pool, timeouts."
  :version "0.1.0"
  :license "BSD-2-Clause"
  :depends-on ("sb-concurrency" "sb-bsd-sockets")
  :pathname "src/core/"
  ;; The folders are the core's layers (doc/layout.md), each built on those
  ;; it names; a file calls only functions of the files it is built on.
  :components ((:file "package")
               (:module "os" :depends-on ("package")
                :components ((:file "syscalls")
                             (:file "cpus" :depends-on ("syscalls"))
                             (:file "buffers" :depends-on ("syscalls"))
                             (:file "openssl" :depends-on ("syscalls"))
                             (:file "listen" :depends-on ("syscalls"))))
               (:module "pool" :depends-on ("os")
                :components ((:file "sizing")
                             (:file "pool" :depends-on ("sizing"))
                             (:file "groups" :depends-on ("pool"))
                             (:file "worker" :depends-on ("groups"))
                             (:file "maker" :depends-on ("worker"))
                             (:file "start" :depends-on ("maker"))))
               (:file "account" :depends-on ("package"))
               (:file "engine" :depends-on ("pool" "account"))
               (:file "settings" :depends-on ("engine"))
               (:module "http" :depends-on ("engine")
                :components ((:file "chunks")
                             (:file "spool")
                             (:file "request" :depends-on ("chunks" "spool"))
                             (:file "connection" :depends-on ("request"))
                             (:file "tls-io" :depends-on ("connection"))
                             (:file "input" :depends-on ("tls-io"))
                             (:file "output-queue" :depends-on ("input"))
                             (:file "output" :depends-on ("output-queue"))
                             (:file "http1" :depends-on ("output"))
                             (:file "head" :depends-on ("http1"))
                             (:file "body" :depends-on ("head"))
                             (:file "tls" :depends-on ("body"))))
               (:module "timers" :depends-on ("http")
                :components ((:file "timers")
                             (:file "wheel")))
               (:module "loop" :depends-on ("timers")
                :components ((:file "lifecycle")
                             (:file "accept" :depends-on ("lifecycle"))
                             (:file "handler" :depends-on ("lifecycle"))
                             (:file "stream" :depends-on ("handler"))
                             (:file "overload" :depends-on ("lifecycle"))
                             (:file "upgrade" :depends-on ("handler" "overload"))
                             (:file "serve" :depends-on ("upgrade"))
                             (:file "shed" :depends-on ("upgrade"))
                             (:file "housekeeper" :depends-on ("accept" "serve" "shed"))))
               (:file "server" :depends-on ("loop" "settings"))
               (:file "metrics" :depends-on ("server"))))

(defsystem "gallop/native"
  :description "Gallop's native app API (Clack convention): own HTTP/1.1 parsing and writing."
  :version "0.1.0"
  :license "BSD-2-Clause"
  :depends-on ("gallop/core")
  :pathname "src/"
  :serial t
  :components ((:file "package")
               (:module "native"
                :serial t
                :components ((:file "types")
                             (:file "octet-stream")
                             (:file "response")
                             (:file "request")
                             (:file "access-log")
                             (:file "server")
                             (:file "running")
                             (:file "websocket-frames")
                             (:file "socket")
                             (:file "zlib")
                             (:file "websocket-handshake")
                             (:file "websocket")
                             (:file "metrics")))))

(defsystem "gallop"
  :description "A drop-in, event-driven upgrade for Hunchentoot."
  :version "0.1.0"
  :license "BSD-2-Clause"
  :depends-on ("gallop/native" "hunchentoot" "chunga" "cl-ppcre" "usocket" "cl+ssl" "bordeaux-threads"
               "sb-introspect")
  :pathname "src/hunchentoot/"
  :serial t
  :components ((:file "package")
               (:file "served")
               (:file "compat")
               (:file "errors")
               (:file "socket")
               (:file "heads")
               (:file "memo")
               (:file "in-progress")
               (:file "request-loop")
               (:file "taskmaster")
               (:file "defer")
               (:file "acceptor")
               (:file "access-log")
               (:file "metrics"))
  :in-order-to ((test-op (test-op "gallop/tests"))))

(defsystem "gallop/tests"
  :description "Gallop's tests: real servers, real sockets, real clients."
  :depends-on ("gallop" "fiveam" "drakma" "usocket" "sb-posix" "sb-md5")
  :pathname "tests/"
  :serial t
  :components ((:file "package")
               (:file "util")
               (:file "strict-reader")
               (:file "core/engine")
               (:file "core/head")
               (:file "core/parse-head")
               (:file "core/emfile")
               (:file "core/deadline")
               (:file "core/aborts")
               (:file "core/chunks")
               (:file "core/chunk-decoder")
               (:file "core/octets")
               (:file "core/decimal")
               (:file "core/wheel")
               (:file "core/timers")
               (:file "core/budget")
               (:file "core/cpus")
               (:file "core/sizing")
               (:file "core/settings")
               (:file "core/contract")
               (:file "core/answers")
               (:file "core/gather")
               (:file "core/epoll-close")
               (:file "core/slow-readers")
               (:file "core/every-core")
               (:file "hunchentoot/handlers")
               (:file "hunchentoot/requests")
               (:file "hunchentoot/pool")
               (:file "hunchentoot/taskmaster")
               (:file "hunchentoot/compat")
               (:file "hunchentoot/stock")
               (:file "hunchentoot/lifecycle")
               (:file "hunchentoot/ssl")
               (:file "hunchentoot/tls")
               (:file "hunchentoot/connections")
               (:file "core/tls")
               (:file "native/app")
               (:file "native/timers")
               (:file "native/sse")
               (:file "native/parser")
               (:file "native/bodies")
               (:file "native/socket")
               (:file "production/listen")
               (:file "production/metrics")
               (:file "production/stop")
               (:file "production/access-log")
               (:file "production/deploy")
               (:file "hunchentoot/bodies")
               (:file "hunchentoot/heads")
               (:file "hunchentoot/errors")
               (:file "hunchentoot/memo")
               (:file "core/uploads")
               (:file "clack/handler")
               (:file "clack/websockets")
               (:file "hunchentoot/switched")
               (:file "native/websocket")
               (:file "native/ws-ends")
               (:file "native/broadcast")
               (:file "native/overload")
               (:file "native/chat")
               ;; the conformance corpus (make conformance also runs it against nginx)
               (:file "conformance/corpus")
               (:file "conformance/runner")
               (:file "conformance/websocket-corpus")
               (:file "conformance/websocket-runner")
               ;; run in child processes by stress/shutdown, stress/websockets,
               ;; stress/slow-read and core/uploads
               (:static-file "child/stop-server.lisp")
               (:static-file "child/upload-server.lisp")
               (:static-file "child/ws-server.lisp")
               (:static-file "child/switched-server.lisp")
               (:static-file "child/broadcast-server.lisp")
               (:static-file "child/ws-echo-server.lisp")
               (:static-file "child/stream-server.lisp")
               (:static-file "clients/ws-client.py")
               (:static-file "clients/chromium-chat.py"))
  :perform (test-op (o c) (symbol-call :gallop-tests :run-all-tests)))

(defsystem "gallop/stress"
  :description "Gallop's stress tests (`make test-stress`): load, CPU hogs, thousands of
connections, the pool's ceilings.  Not deterministic enough for CI."
  :depends-on ("gallop/tests")
  :pathname "tests/stress/"
  :serial t
  :components ((:file "suite")
               (:file "pool")
               (:file "connections")
               (:file "shutdown")
               (:file "switched")
               (:file "slow-read")
               (:file "restart")
               (:file "websockets")
               (:file "broadcast"))
  :perform (test-op (o c) (symbol-call :gallop-tests :run-all-tests :stress)))
