;;;; broadcast-server.lisp -- a native Gallop server in a child process that
;;;; sends 16 KiB to every WebSocket it holds every 20 ms, for the stress
;;;; test of clients that never read (tests/stress/broadcast.lisp): a heap
;;;; that runs out kills this process, not the test's.
;;;;
;;;;   scripts/lisp.sh --load tests/child/broadcast-server.lisp --end-toplevel-options MODE
;;;;
;;;; MODE is broadcast (one GALLOP:WS-BROADCAST to all of them) or send
;;;; (GALLOP:WS-SEND to each in turn).  It listens on 127.0.0.1 and a free
;;;; port: a WebSocket at any path, anything else 200 "ok".  It talks to the
;;;; test on standard input/output:
;;;;   prints "READY <port>" once it listens;
;;;;   "stats" -> "STATS <plist>": :CLIENTS held, the memory account's :OUTPUT
;;;;              now and at its peak since the last "reset", its :LIMIT, the heap in use
;;;;              after a collection at its peak, the server's :SLOW-CLIENTS
;;;;              and :OPEN connections, ON-CLOSE codes seen;
;;;;   "gc"    -> "HEAP <octets>": the heap in use after a full collection;
;;;;   "reset" -> "RESET": peaks start again;
;;;;   "quit" or end of file -> exits.

(load (merge-pathnames "protocol.lisp" *load-truename*))
(defpackage #:gallop-broadcast-server (:use #:common-lisp #:gallop-child))
(in-package #:gallop-broadcast-server)

(defvar *mode* (intern (string-upcase (or (second sb-ext:*posix-argv*) "broadcast")) :keyword))

(asdf:load-system "gallop/native")

(defvar *lock* (sb-thread:make-mutex :name "clients"))
(defvar *clients* '())
(defvar *codes* '() "(CODE . COUNT) of the ON-CLOSE codes seen.")

(sb-ext:defglobal *peak-output* 0)
(sb-ext:defglobal *peak-heap* 0)

(push (lambda () (setf *peak-heap* (max *peak-heap* (sb-kernel:dynamic-usage))))
      sb-ext:*after-gc-hooks*)

(defun app (env)
  (if (gallop:websocket-request-p env)
      (gallop:accept-websocket
       env :on-open (lambda (ws) (sb-thread:with-mutex (*lock*) (push ws *clients*)))
           :on-close (lambda (ws code reason)
                       (declare (ignore reason))
                       (sb-thread:with-mutex (*lock*)
                         (setf *clients* (delete ws *clients*))
                         (let ((entry (assoc code *codes*)))
                           (if entry (incf (cdr entry)) (push (cons code 1) *codes*))))))
      '(200 (:content-type "text/plain") ("ok"))))

(defvar *server* (gallop:start #'app :address "127.0.0.1" :port 0 :log nil))

(defun tick ()
  "Send 16 KiB (fresh octets, as an app's data would be) to every client,
then again in 20 ms."
  (let ((message (make-array (* 16 1024) :element-type '(unsigned-byte 8) :initial-element 42))
        (clients (sb-thread:with-mutex (*lock*) (copy-list *clients*))))
    (ecase *mode*
      (:broadcast (gallop:ws-broadcast clients message))
      (:send (dolist (ws clients) (gallop:ws-send ws message))))
    ;; The account's :OUTPUT read directly (ACCOUNT-USED, account.lisp, an
    ;; internal), not through GALLOP:STATS, which walks every connection:
    ;; this runs every 20 ms beside the load it measures.
    (setf *peak-output* (max *peak-output* (gallop.core::account-used :output))))
  (gallop:after 0.02 #'tick :server *server*))

(gallop:after 0.02 #'tick :server *server*)

(reply "READY ~D" (gallop:server-port *server*))

(loop for line = (read-line *standard-input* nil)
      while line
      do (let ((command (string-trim " " line)))
           (cond ((string= command "stats")
                  (let ((stats (gallop:stats *server*)))
                    (reply "STATS ~S"
                           (list :clients (sb-thread:with-mutex (*lock*) (length *clients*))
                                 :output (getf (getf stats :memory) :output)
                                 :limit (getf stats :memory-limit)
                                 :peak-output *peak-output*
                                 :peak-heap *peak-heap*
                                 :slow-clients (getf stats :slow-clients)
                                 :open (getf stats :open)
                                 :codes (sb-thread:with-mutex (*lock*) (copy-alist *codes*))))))
                 ((string= command "gc")
                  (sb-ext:gc :full t)
                  (reply "HEAP ~D" (sb-kernel:dynamic-usage)))
                 ((string= command "reset")
                  (setf *peak-output* 0 *peak-heap* 0)
                  (reply "RESET"))
                 ((string= command "quit") (return)))))

(gallop:stop *server*)
(sb-ext:exit :code 0 :abort t)
