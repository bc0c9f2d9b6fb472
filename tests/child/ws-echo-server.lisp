;;;; ws-echo-server.lisp -- a native WebSocket echo (GALLOP:ACCEPT-WEBSOCKET)
;;;; in a child process, with the server's default settings, for tests that
;;;; need the server under an fd limit of its own:
;;;;
;;;;   prlimit --nofile=256:256 scripts/lisp.sh --load tests/child/ws-echo-server.lisp
;;;;
;;;; It listens on 127.0.0.1 and a free port, and talks to the test on
;;;; standard input/output: prints "READY <port>" once it listens; "stats"
;;;; -> "STATS <plist>" (GALLOP:STATS); "quit" or end of file -> exits.

(load (merge-pathnames "protocol.lisp" *load-truename*))
(defpackage #:gallop-ws-echo-server (:use #:common-lisp #:gallop-child))
(in-package #:gallop-ws-echo-server)

(asdf:load-system "gallop/native")

(defvar *server*
  (gallop:start (lambda (env)
                  (if (gallop:websocket-request-p env)
                      (gallop:accept-websocket
                       env :on-message (lambda (ws message) (gallop:ws-send ws message)))
                      '(200 (:content-type "text/plain") ("ok"))))
                :address "127.0.0.1" :port 0 :log nil))

(reply "READY ~D" (gallop:server-port *server*))

(loop for line = (read-line *standard-input* nil)
      while line
      do (let ((command (string-trim " " line)))
           (cond ((string= command "stats")
                  (reply "STATS ~S" (gallop:stats *server*)))
                 ((string= command "quit")
                  (return)))))

(gallop:stop *server*)
(sb-ext:exit :abort t)
