;;;; broadcast.lisp -- sending to WebSockets whose clients do not read
;;;; (src/native/websocket.lisp, WS-BROADCAST and the send limit; the
;;;; queues in src/core/loop/upgrade.lisp): a broadcast's frame is one
;;;; vector shared by every queue and counted once in the memory account;
;;;; each client still reads it byte for byte; a client past its send limit
;;;; gets what the socket was taking, then a close frame with 1008, then end
;;;; of file; small sends to a non-reader share buffers.
;;;;
;;;; The clients' receive buffers are made small before they connect
;;;; (SLOW-READER, tests/core/slow-readers.lisp), so that what the server
;;;; sends them waits in its queues until the test reads.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: a WebSocket connection's
;;;; queues (the upgrade's mailbox, the unsent segments, whether a segment is
;;;; shared) and the account's footprint of a vector (OCTETS-FOOTPRINT,
;;;; +BUFFER-SIZE+): that a broadcast is one shared vector counted once is
;;;; what is tested, and only the queues show it.

(in-package #:gallop-tests)

(in-suite native)

(defvar *accepted* '() "The WebSockets BROADCAST-APP accepted, newest first.")
(defvar *accepted-lock* (sb-thread:make-mutex :name "accepted"))
(defvar *ended* '() "(CODE REASON) of each ON-CLOSE of BROADCAST-APP's, newest first.")

(defun broadcast-app (env)
  "Accepts every WebSocket (permessage-deflate when offered) and notes it;
sends nothing itself: the test does."
  (if (gallop:websocket-request-p env)
      (gallop:accept-websocket
       env :deflate t :deflate-min-bytes 64
           :on-open (lambda (ws)
                      (sb-thread:with-mutex (*accepted-lock*) (push ws *accepted*)))
           :on-close (lambda (ws code reason)
                       (declare (ignore ws))
                       (sb-thread:with-mutex (*accepted-lock*) (push (list code reason) *ended*))))
      '(200 (:content-type "text/plain") ("plain"))))

(defmacro with-broadcast-app ((server port &rest options) &body body)
  `(progn (setf *accepted* '() *ended* '())
          (with-app (,server #'broadcast-app ,@options)
            (let ((,port (native-port ,server)))
              ,@body))))

(defstruct (lagging (:constructor %make-lagging (socket stream)))
  socket stream)

(defun lagging-ws (port &key deflate)
  "A WebSocket client to PORT with a 4 KiB receive buffer, its 101 read
exactly (with permessage-deflate agreed when DEFLATE); it reads nothing
more until the test says (LAGGING-READ)."
  (let* ((socket (slow-reader port))
         (client (%make-lagging socket (slow-reader-stream socket))))
    (slow-reader-send socket (if deflate (ws-handshake "/" *deflate-offer*) (ws-handshake "/")))
    (let ((expected (octets (apply #'crlf "HTTP/1.1 101 Switching Protocols" "Upgrade: websocket"
                                   "Connection: Upgrade"
                                   (format nil "Sec-WebSocket-Accept: ~A" *rfc-accept*)
                                   (and deflate
                                        (list "Sec-WebSocket-Extensions: permessage-deflate; server_no_context_takeover; client_no_context_takeover"))))))
      (is (equalp expected (lagging-read client (length expected))) "the 101"))
    client))

(defun lagging-read (client n)
  "The next N octets CLIENT gets (fewer at end of file)."
  (let* ((out (make-array n :element-type '(unsigned-byte 8)))
         (got (read-sequence out (lagging-stream client))))
    (if (= got n) out (subseq out 0 got))))

(defun lagging-eof-p (client)
  (null (read-byte (lagging-stream client) nil nil)))

(defun lagging-frame (client)
  "The next frame CLIENT gets, as (values FIRST-OCTET PAYLOAD), unmasked as
a server sends it; NIL at end of file."
  (let ((head (lagging-read client 2)))
    (when (= 2 (length head))
      (is (not (logbitp 7 (aref head 1))) "a server's frame is not masked")
      (let* ((short (logand (aref head 1) 127))
             (length (case short
                       (126 (let ((b (lagging-read client 2))) (logior (ash (aref b 0) 8) (aref b 1))))
                       (127 (let ((b (lagging-read client 8)))
                              (loop for octet across b for n = octet then (logior (ash n 8) octet)
                                    finally (return n))))
                       (t short))))
        (values (aref head 0) (lagging-read client length))))))

(defun close-lagging (clients)
  (dolist (client clients) (ignore-errors (sb-bsd-sockets:socket-close (lagging-socket client)))))

(defun noise (n seed)
  "N octets no compressor shrinks."
  (let ((state (sb-ext:seed-random-state seed))
        (v (make-array n :element-type '(unsigned-byte 8))))
    (dotimes (i n v) (setf (aref v i) (random 256 state)))))

(defun queued-segments (ws)
  "The segments WS's connection holds for its client: its mailbox's and its
output queue's (read from the test's thread: a snapshot)."
  (let* ((c (gallop::ws-connection ws))
         (u (gallop.core::conn-slot c gallop.core::upgrade)))
    (append (copy-list (gallop.core::upgrade-mailbox u))
            (copy-list (gallop.core::conn-slot c gallop.core::unsent)))))

(defun queued-frame (ws first-octet)
  "The octets of the shared frame starting with FIRST-OCTET that WS's
connection holds, or NIL."
  (loop for segment in (queued-segments ws)
        for octets = (gallop.core::segment-octets segment)
        when (and octets (gallop.core::segment-shared segment) (plusp (length octets))
                  (= first-octet (aref octets 0)))
          return octets))

(defun inflate-payload (payload)
  "What the payload of a compressed message inflates to."
  (let ((in (concat-octets payload #(0 0 #xFF #xFF))))
    (multiple-value-bind (out n) (gallop::inflate-message in (length in) (* 1024 1024) (constantly t))
      (if (symbolp out) out (subseq out 0 n)))))

(test ws-broadcast-shares-one-frame
  "A broadcast to five clients that read nothing yet: each queue holds the
same vector (one for those with permessage-deflate, compressed once), the
memory account counts each frame once, each client's backlog counts it in
full, and each client then reads it byte for byte.  Once read, the account
is back where it was."
  (with-broadcast-app (server port :upgraded-send-limit (* 8 1024 1024))
    (let ((clients '()))
      (unwind-protect
           (progn
             (dotimes (i 3) (push (lagging-ws port) clients))
             (dotimes (i 2) (push (lagging-ws port :deflate t) clients))
             (is (wait-until (lambda () (= 5 (length *accepted*)))))
             (let* ((websockets *accepted*)
                    (plain (remove-if #'gallop::ws-deflate websockets))
                    (deflating (remove-if-not #'gallop::ws-deflate websockets))
                    (before (memory-used :output))
                    ;; In front, so that what follows waits in the queues.
                    (filler (noise (* 1024 1024) 11))
                    (text (format nil "~{line ~D; ~}" (loop for i below 2000 collect i)))
                    (text-octets (sb-ext:string-to-octets text :external-format :utf-8))
                    (plain-frame (coerce (server-frame 1 text-octets) 'octets-vector)))
               (is (= 2 (length deflating)))
               (is (= 5 (gallop:ws-broadcast websockets filler)))
               (is (= 5 (gallop:ws-broadcast websockets text)))
               (is (wait-until (lambda ()
                                 (and (every (lambda (ws) (queued-frame ws #x81)) plain)
                                      (every (lambda (ws) (queued-frame ws #xC1)) deflating)))))
               (let ((plain-octets (mapcar (lambda (ws) (queued-frame ws #x81)) plain))
                     (deflated-octets (mapcar (lambda (ws) (queued-frame ws #xC1)) deflating)))
                 (is (every (lambda (o) (eq o (first plain-octets))) plain-octets)
                     "the plain recipients' queues hold one vector")
                 (is (every (lambda (o) (eq o (first deflated-octets))) deflated-octets)
                     "the deflating recipients' queues hold one vector")
                 (is (equalp plain-frame (first plain-octets)))
                 (is (< (length (first deflated-octets)) (length plain-frame)))
                 (is (= (+ (gallop.core::octets-footprint (+ (length filler) 10))
                           (gallop.core::octets-footprint (length plain-frame))
                           (gallop.core::octets-footprint (length (first deflated-octets))))
                        (- (memory-used :output) before))
                     "counted once: ~D octets more, for frames of ~D, ~D and ~D"
                     (- (memory-used :output) before) (+ (length filler) 10)
                     (length plain-frame) (length (first deflated-octets))))
               (dolist (ws plain)
                 (is (>= (gallop:ws-pending ws) (length plain-frame))
                     "a recipient's backlog counts the frame in full"))
               ;; Each client reads all of it.
               (dolist (client clients)
                 (multiple-value-bind (first payload) (lagging-frame client)
                   (is (eql #x82 first))
                   (is (equalp filler payload) "the filler, byte for byte"))
                 (multiple-value-bind (first payload) (lagging-frame client)
                   (case first
                     (#x81 (is (equalp text-octets payload) "the text, byte for byte"))
                     (#xC1 (is (equalp text-octets (inflate-payload payload))
                               "the compressed text inflates to it"))
                     (t (is nil "the text's frame begins with ~S" first)))))
               (is (wait-until (lambda () (= before (memory-used :output))))
                   "the account is given back once all is read: ~D, not ~D"
                   (memory-used :output) before)))
        (close-lagging clients))
      (is (wait-until (lambda () (zerop (stat server :open))))))))

(defun numbered-message (i size)
  "SIZE octets that begin with I (two octets) and a pattern of I."
  (let ((v (make-array size :element-type '(unsigned-byte 8))))
    (dotimes (k size v) (setf (aref v k) (mod (+ (* 7 k) i) 256)))
    (setf (aref v 0) (ldb (byte 8 8) i) (aref v 1) (ldb (byte 8 0) i))
    v))

(defun send-until-refused (ws size)
  "WS-SEND numbered messages of SIZE octets until one is refused: how many
were taken."
  (loop for i from 0 below 10000
        while (gallop:ws-send ws (numbered-message i size))
        count t))

(test ws-send-past-the-limit-closes-with-1008
  "A client that does not read: sends are taken until its backlog passes
the send limit, then refused.  When it reads, it gets the first messages
whole and in order (those the socket had begun to take), a close frame with
1008 (policy violation), then end of file: the rest was dropped.  ON-CLOSE gets 1008,
the slow client is counted, the account is given back."
  ;; No minimum rate: a client that reads nothing for its grace would be
  ;; closed by it too, with no close frame, on a slow host.
  (with-broadcast-app (server port :upgraded-send-limit (* 64 1024) :min-data-rate nil)
    (let ((client (lagging-ws port))
          (before (memory-used :output)))
      (unwind-protect
           (progn
             (is (wait-until (lambda () *accepted*)))
             (let* ((ws (first *accepted*))
                    (taken (send-until-refused ws (* 16 1024)))
                    (read 0))
               (is (< 1 taken 10000) "~D sends taken" taken)
               (is (null (gallop:ws-send ws "late")))
               (loop
                 (multiple-value-bind (first payload) (lagging-frame client)
                   (cond ((eql first #x82)
                          (is (equalp (numbered-message read (* 16 1024)) payload)
                              "message ~D whole and in order" read)
                          (incf read))
                         (t
                          (is (eql #x88 first) "a close frame, not ~S" first)
                          (is (equalp (concat-octets (ws-close-payload 1008 "too far behind"))
                                      payload))
                          (return)))))
               (is (lagging-eof-p client) "end of file after the close frame")
               (is (< read taken) "~D of ~D messages read before the close" read taken))
             (is (wait-until (lambda () (equal '((1008 "too far behind")) *ended*))))
             (is (= 1 (stat server :slow-clients)))
             (is (wait-until (lambda () (= before (memory-used :output))))))
        (close-lagging (list client))))))

(test ws-non-reader-past-the-limit-is-aborted
  "A client past its send limit that never reads does not get its close
frame: the connection is aborted a few seconds later, ON-CLOSE gets 1008,
and the account is given back, while the client still reads nothing."
  (with-broadcast-app (server port :upgraded-send-limit (* 64 1024))
    (let ((client (lagging-ws port))
          (before (memory-used :output)))
      (unwind-protect
           (progn
             (is (wait-until (lambda () *accepted*)))
             (is (< 1 (send-until-refused (first *accepted*) (* 16 1024))))
             (is (wait-until (lambda () (equal '((1008 "too far behind")) *ended*)) :timeout 20))
             (is (wait-until (lambda () (zerop (stat server :open)))))
             (is (wait-until (lambda () (= before (memory-used :output))))))
        (close-lagging (list client))))))

(test ws-small-sends-to-a-non-reader-share-buffers
  "Thousands of small messages to a client that does not read wait in a
few pool buffers, not in one each, and the account counts those buffers;
the client then reads every one in order."
  (with-broadcast-app (server port :upgraded-send-limit (* 8 1024 1024))
    (let ((client (lagging-ws port))
          (before (memory-used :output)))
      (unwind-protect
           (progn
             (is (wait-until (lambda () *accepted*)))
             (let* ((ws (first *accepted*))
                    (count 3000)
                    (size 100))
               (dotimes (i count)
                 (gallop:ws-send ws (numbered-message i size)))
               (is (wait-until (lambda () (null (gallop.core::upgrade-mailbox
                                                 (gallop.core::conn-slot (gallop::ws-connection ws)
                                                                         gallop.core::upgrade)))))
                   "the mailbox drained into the queue")
               (let ((pending (gallop:ws-pending ws))
                     (segments (length (queued-segments ws))))
                 (is (> pending (* 200 (+ size 2))) "~D octets wait" pending)
                 (is (<= segments (+ 2 (ceiling pending gallop.core::+buffer-size+)))
                     "~D segments hold ~D octets" segments pending)
                 ;; A frame the socket took part of stays a segment of its
                 ;; own, counted by its own size: the account is compared
                 ;; with what each segment says it holds, once the worker
                 ;; that drained the mailbox has parked the connection.
                 (flet ((held ()
                          (reduce #'+ (queued-segments ws)
                                  :key #'gallop.core::segment-counted)))
                   (is (wait-until (lambda () (= (held) (- (memory-used :output) before))))
                       "the account counts ~D octets, the segments hold ~D"
                       (- (memory-used :output) before) (held))
                   (let* ((now (queued-segments ws))
                          (buffer (gallop.core::octets-footprint gallop.core::+buffer-size+))
                          (buffers (count buffer now :key #'gallop.core::segment-counted)))
                     (is (<= (- (length now) 2) buffers)
                         "~D of ~D segments are pool buffers" buffers (length now)))))
               (dotimes (i count)
                 (multiple-value-bind (first payload) (lagging-frame client)
                   (unless (and (eql #x82 first) (equalp (numbered-message i size) payload))
                     (is nil "message ~D: ~S ~S" i first (and payload (subseq payload 0 (min 8 (length payload)))))
                     (return))))
               (is (wait-until (lambda () (= before (memory-used :output)))))))
        (close-lagging (list client))))))
