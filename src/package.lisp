;;;; package.lisp -- the GALLOP package, the one users name.
;;;;
;;;; Defined with what system gallop/native serves (the native app API, no
;;;; Hunchentoot needed) and the names common to both front ends.  The
;;;; drop-in Hunchentoot names (GALLOP:EASY-ACCEPTOR ...) are exported by the
;;;; Hunchentoot layer itself (src/hunchentoot/package.lisp), when it loads,
;;;; so that gallop/native alone exports nothing without a definition.

(defpackage #:gallop
  (:use #:common-lisp)
  (:import-from #:gallop.core
                #:connection #:connection-mark-boundary #:connection-owner-stream
                #:connection-user-data #:connection-remote-address
                #:connection-remote-port #:connection-local-address
                #:connection-local-port)
  (:import-from #:gallop.core #:handler-timeout #:set-memory-limit)
  (:export
   ;; signalled in a handler that ran past its deadline (:HANDLER-TIMEOUT)
   #:handler-timeout
   ;; native app API (Clack convention)
   #:start
   #:stop
   #:server
   #:server-port
   #:server-address
   ;; both front ends: a server's or a taskmaster's statistics
   #:stats
   ;; both front ends: the limit of the process's memory account (account.lisp)
   #:set-memory-limit
   ;; both front ends: readiness, draining, a graceful stop on SIGTERM
   #:ready-p #:drain #:readiness-response #:running-servers #:stop-all-softly
   #:stop-on-sigterm
   ;; native app API: the access log's files opened again (logrotate)
   #:reopen-access-logs #:reopen-logs-on-sighup
   ;; both front ends: a thunk run on a worker later, with no thread waiting
   #:after
   #:cancel-timer
   #:server-pool
   ;; native app API: the connection as a socket, once the app switched
   ;; protocols (the environment's :CLACK.IO)
   #:env-socket #:socket-read-callback #:socket-close-callback #:socket-write
   #:socket-pending #:socket-close
   ;; native app API: WebSockets (RFC 6455)
   #:websocket-request-p #:accept-websocket #:websocket #:ws-send #:ws-broadcast #:ws-ping #:ws-close
   #:ws-pending #:ws-protocol #:ws-env #:ws-user-data
   ;; both front ends: metrics in Prometheus' text format (the native app here)
   #:metrics-text #:metrics-app))
